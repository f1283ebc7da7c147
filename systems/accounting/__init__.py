"""Executable arithmetic: parameters, FLOPs and memory of the Transformer LM (transformer.py), the parallelism
arithmetic of the scaling book (scaling.py), and bucketed all-reduce time (allreduce.py)."""

from systems.accounting.allreduce import BucketedAllReduce, fit_bucketed_allreduce
from systems.accounting.scaling import (TPU_V5P_BYTES, TPU_V5P_FLOPS, TPU_V5P_ICI_BANDWIDTH, XXL, ComputeBoundBatch,
                                        FFNStack, devices_to_hold, fsdp_tp_compute_bound_batch)
from systems.accounting.transformer import (GB, H100_BYTES, Activations, Flops, ModelState, PeakMemory,
                                            activation_memory, count_matmul_parameters, count_parameters, flops,
                                            model_state, peak_memory, residual_stream_bytes)

__all__ = ["GB", "H100_BYTES", "TPU_V5P_BYTES", "TPU_V5P_FLOPS", "TPU_V5P_ICI_BANDWIDTH", "XXL", "Activations",
           "BucketedAllReduce", "ComputeBoundBatch", "FFNStack", "Flops", "ModelState", "PeakMemory",
           "activation_memory", "count_matmul_parameters", "count_parameters", "devices_to_hold", "flops",
           "fit_bucketed_allreduce", "fsdp_tp_compute_bound_batch", "model_state", "peak_memory",
           "residual_stream_bytes"]
