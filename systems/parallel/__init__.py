"""Data parallelism: rank pools and launch (ranks), the DDP wrappers (ddp), the data-parallel training loop and
its torchrun entry point (train), and the clock and memory meters of its steps (meters); sharding: FSDP and its
collectives (fsdp, collectives), layouts of ranks into replicas, shards and tensor-parallel groups (mesh), and
tensor parallelism (tensor)."""
