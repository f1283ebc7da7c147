"""Executable arithmetic: parameters and memory of the Transformer LM (transformer.py; its LM head and loss:
loss.py) and its FLOPs (flops.py), with activation checkpointing (checkpointing.py) and written-out attention's seq²
tensors (scores.py), the parallelism arithmetic of the scaling book (scaling.py), one SwiGLU layer under DP, FSDP,
TP and FSDP x TP (ffn_layouts.py: the 2026 handout's section 8), bucketed all-reduce time (allreduce.py), per-rank
memory under FSDP and HSDP (sharding.py), the bytes a rank sends on each axis of a layout, collective by collective
(traffic.py), and which layout a cluster of nodes runs fastest (layouts.py)."""

from systems.accounting.activations import Activations
from systems.accounting.allreduce import BucketedAllReduce, fit_bucketed_allreduce
from systems.accounting.checkpointing import recomputed_blocks
from systems.accounting.ffn_layouts import (RING_COLLECTIVES, Accelerator, Collective, DeviceBound, FSDPTPGrid,
                                             PassCost, StepCost, SwiGLULayer, dp_step, fsdp_step, fsdp_tp_step,
                                             largest_dp_devices, largest_fsdp_devices, largest_fsdp_tp_grid,
                                             largest_tp_devices, smallest_batch_per_device, tp_step)
from systems.accounting.flops import Flops, flops, recomputed_flops
from systems.accounting.layouts import Cluster, Compute, LayoutStep, Links, fastest, predict_layouts
from systems.accounting.scaling import (TPU_V5P_BYTES, TPU_V5P_FLOPS, TPU_V5P_ICI_BANDWIDTH, XXL, ComputeBoundBatch,
                                        FFNStack, devices_to_hold, fsdp_tp_compute_bound_batch)
from systems.accounting.sharding import ShardedMemory, fsdp_memory, hsdp_memory, sharded_weights
from systems.accounting.traffic import AxisTraffic, StepCollective, ddp_traffic, hsdp_traffic
from systems.accounting.transformer import (GB, H100_BYTES, ModelState, PeakMemory, activation_memory,
                                            checkpointed, count_matmul_parameters, count_parameters,
                                            kept_weight_copies, largest_context, model_state, nested_checkpoint,
                                            parameter_numels, peak_memory, residual_stream_bytes)

__all__ = ["GB", "H100_BYTES", "RING_COLLECTIVES", "TPU_V5P_BYTES", "TPU_V5P_FLOPS", "TPU_V5P_ICI_BANDWIDTH", "XXL",
           "Accelerator", "Activations", "AxisTraffic", "BucketedAllReduce", "Cluster", "Collective",
           "Compute", "ComputeBoundBatch", "DeviceBound", "FFNStack", "FSDPTPGrid", "Flops", "LayoutStep", "Links",
           "ModelState", "PassCost", "PeakMemory", "ShardedMemory", "StepCollective", "StepCost", "SwiGLULayer",
           "activation_memory", "checkpointed", "count_matmul_parameters", "count_parameters",
           "ddp_traffic", "devices_to_hold", "dp_step", "fastest", "fit_bucketed_allreduce", "flops", "fsdp_memory",
           "fsdp_step", "fsdp_tp_compute_bound_batch", "fsdp_tp_step", "hsdp_memory", "hsdp_traffic",
           "kept_weight_copies", "largest_context", "largest_dp_devices", "largest_fsdp_devices",
           "largest_fsdp_tp_grid", "largest_tp_devices", "model_state", "nested_checkpoint", "parameter_numels",
           "peak_memory", "predict_layouts", "recomputed_blocks", "recomputed_flops", "residual_stream_bytes",
           "sharded_weights", "smallest_batch_per_device", "tp_step"]
