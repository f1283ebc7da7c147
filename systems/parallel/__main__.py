"""The torchrun entry point: `train(spec)` on every rank of an env:// process group; rank 0 prints the result.

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node 2 -m systems.parallel \\
        --preset small --variant bucketed --bucket-size-mb 25 --steps 10

One option per TrainSpec field (`--bucket-size-mb` for bucket_size_mb), each parsed by TrainSpec with its
lever's own parser: `--checkpoint every1` (none, everyK, KxK, nested), `--loss-chunk 4096` (or none),
`--precision bf16`, `--fsdp-gather block`.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch
import torch.distributed as dist

from systems.parallel.ranks import init_from_env
from systems.parallel.spec import TrainSpec
from systems.parallel.train import train


def main(argv: list[str] | None = None) -> None:
    backend, spec = parse_args(argv)
    init_from_env(backend)
    try:
        result = train(spec)
        rank = dist.get_rank()
        # No rank tears the group down while another still talks to it: gloo can abort a rank whose peer
        # closed their connection under it.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        print_result(result)


def parse_args(argv: list[str] | None) -> tuple[str, TrainSpec]:
    """The process-group backend and a TrainSpec; a bad lever is argparse's usage error, naming the option."""
    parser = argparse.ArgumentParser(prog="python -m systems.parallel", description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="nccl" if torch.cuda.is_available() else "gloo")
    for field in dataclasses.fields(TrainSpec):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=_FIELD_TYPES.get(field.name, str),
                            default=field.default)
    args = vars(parser.parse_args(argv))
    backend = args.pop("backend")
    try:
        return backend, TrainSpec(**args)
    except ValueError as exc:
        parser.error(str(exc))


def _optional_int(text: str) -> int | None:
    return None if text == "none" else int(text)


# Fields whose text is a number; the others (names, schemes, presets) go to TrainSpec's parsers as text.
_FIELD_TYPES = {"batch_size": int, "context": int, "warmup": int, "steps": int, "seed": int, "lr": float,
                "fsdp_prefetch": int, "bucket_size_mb": float, "loss_chunk": _optional_int}


def print_result(result: dict) -> None:
    for step, loss in enumerate(result["losses"]):
        print(f"step {step} loss {loss!r}")
    print("median ms:", ", ".join(f"{name} {statistics.median(seconds) * 1e3:.3f}"
                                  for name, seconds in result["seconds"].items()))


if __name__ == "__main__":
    main()
