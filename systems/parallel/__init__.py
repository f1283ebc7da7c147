"""Data parallelism: rank pools and launch, the DDP wrappers, and the data-parallel training loop."""
