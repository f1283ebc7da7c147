"""Parallel training: rank pools and launch (ranks), the DDP wrappers (ddp), FSDP and its collectives (fsdp,
collectives), layouts of ranks into replicas, shards and tensor-parallel groups (mesh), tensor parallelism
(tensor), a run's configuration (spec; its levers are systems.levers'), the wrapper each variant trains with
(parallelize), the training loop (train) with its clock and memory meters (meters), and the torchrun entry point
(`python -m systems.parallel`)."""
