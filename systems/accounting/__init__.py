"""Executable arithmetic: parameters, FLOPs and memory of the Transformer LM (transformer.py), with activation
checkpointing (checkpointing.py) and written-out attention's seq² tensors (scores.py), the parallelism
arithmetic of the scaling book (scaling.py), bucketed all-reduce time (allreduce.py), per-rank memory under
FSDP and HSDP (sharding.py), and the bytes a rank sends on each axis of a layout (traffic.py)."""

from systems.accounting.allreduce import BucketedAllReduce, fit_bucketed_allreduce
from systems.accounting.checkpointing import SCHEMES, recomputed_blocks
from systems.accounting.scaling import (TPU_V5P_BYTES, TPU_V5P_FLOPS, TPU_V5P_ICI_BANDWIDTH, XXL, ComputeBoundBatch,
                                        FFNStack, devices_to_hold, fsdp_tp_compute_bound_batch)
from systems.accounting.sharding import ShardedMemory, fsdp_memory, hsdp_memory, sharded_weights
from systems.accounting.traffic import AxisTraffic, hsdp_traffic
from systems.accounting.transformer import (GB, H100_BYTES, Activations, Flops, ModelState, PeakMemory,
                                            activation_memory, checkpoint_levels, count_matmul_parameters,
                                            count_parameters, flops, largest_context, model_state, nested_checkpoint,
                                            peak_memory, recomputed_flops, residual_stream_bytes)

__all__ = ["GB", "H100_BYTES", "SCHEMES", "TPU_V5P_BYTES", "TPU_V5P_FLOPS", "TPU_V5P_ICI_BANDWIDTH", "XXL",
           "Activations", "AxisTraffic", "BucketedAllReduce", "ComputeBoundBatch", "FFNStack", "Flops", "ModelState",
           "PeakMemory", "ShardedMemory", "activation_memory", "checkpoint_levels", "count_matmul_parameters",
           "count_parameters", "devices_to_hold", "flops", "fit_bucketed_allreduce", "fsdp_memory",
           "fsdp_tp_compute_bound_batch", "hsdp_memory", "hsdp_traffic", "largest_context", "model_state",
           "nested_checkpoint", "peak_memory", "recomputed_blocks", "recomputed_flops", "residual_stream_bytes",
           "sharded_weights"]
