"""The levers of a training run, each typed, with its one parser and default, on a floor below both the
accounting that predicts a run and the parallel code that runs it: checkpointing schemes (checkpointing.py), a
layout of ranks (layout.py), FSDP's gathers (sharding.py), DDP's buckets (buckets.py), and how the ranks share a
step (variant.py). Beside them: `Choice` (systems.choice), precisions (systems.precision) and the model's own
levers (systems.model)."""
