"""The torchrun entry point: `train(spec, schedule)` on every rank of an env:// process group; rank 0 prints the result.

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node 2 -m systems.parallel \\
        --preset small --variant bucketed --bucket-size-mb 25 --steps 10

One option per field of TrainSpec and Schedule (`--bucket-size-mb` for bucket_size_mb, `--steps`), each parsed
with its lever's one parser; beside them `--backend`, `--timeout` and `--save-params FILE` say how the ranks run.
On several nodes, one torchrun per node with the same c10d rendezvous endpoint (docs/multinode.md).
docs/design-notes.md has the options' details.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import statistics
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from systems.levers.spelling import as_option_type
from systems.parallel.parallelize import full_parameters
from systems.parallel.ranks import GROUP_BACKENDS, init_from_env
from systems.parallel.spec import Schedule, TrainSpec
from systems.parallel.train import train

PROG = "python -m systems.parallel"


@dataclass(frozen=True)
class Launch:
    """How this rank runs, beside what it trains: the process group's backend and timeout (seconds), and where
    rank 0 saves the trained parameters (None: nowhere)."""

    backend: str
    timeout: float
    save_params: str | None


def main(argv: list[str] | None = None) -> None:
    launch, spec, schedule = parse_args(argv)
    try:
        init_from_env(launch.backend, launch.timeout)
        rank = dist.get_rank()
        if rank == 0:
            print(f"{PROG}: {dist.get_world_size()} ranks on {os.environ.get('GROUP_WORLD_SIZE', '1')} node(s), "
                  f"{spec.variant} over {spec.layout_for(dist.get_world_size())}", flush=True)
        result = train(spec, schedule, _trained_parameters if launch.save_params else None)
        # No rank tears the group down while another still talks to it: gloo can abort a rank whose peer
        # closed their connection under it.
        dist.barrier()
    except BaseException as exc:
        print(f"{PROG}: {where()} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if rank == 0:
        print_result(result)
        if launch.save_params:
            torch.save(result["params"], launch.save_params)


def where() -> str:
    """This rank and its node, as torchrun's environment names them: the node is the rendezvous' group rank."""
    env = os.environ.get
    return (f"rank {env('RANK', '?')} of {env('WORLD_SIZE', '?')} (node {env('GROUP_RANK', '?')} of "
            f"{env('GROUP_WORLD_SIZE', '?')}, local rank {env('LOCAL_RANK', '?')}, host {socket.gethostname()}, "
            f"pid {os.getpid()})")


def _trained_parameters(model, step) -> dict:
    """`train`'s `after_training`: the trained parameters, whole (a collective: every rank gathers)."""
    return {"params": full_parameters(model)}


def parse_args(argv: list[str] | None) -> tuple[Launch, TrainSpec, Schedule]:
    """How the ranks run, a TrainSpec and its Schedule; a bad lever is argparse's usage error, naming the option."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=GROUP_BACKENDS, default="nccl" if torch.cuda.is_available() else "gloo")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds a collective may wait (rendezvous included) before it fails the rank")
    parser.add_argument("--save-params", default=None, help="rank 0 saves the trained parameters here")
    for levers in (TrainSpec, Schedule):
        for field in dataclasses.fields(levers):
            parser.add_argument(f"--{field.name.replace('_', '-')}", type=as_option_type(field.metadata["parse"]),
                                default=field.default, help=field.metadata["help"])
    args = vars(parser.parse_args(argv))
    launch = Launch(*(args.pop(name) for name in ("backend", "timeout", "save_params")))
    if not launch.timeout > 0:
        parser.error(f"--timeout must be positive, got {launch.timeout}")
    try:
        schedule = Schedule(**{field.name: args.pop(field.name) for field in dataclasses.fields(Schedule)})
        spec = TrainSpec(**args)
    except ValueError as exc:
        parser.error(str(exc))
    return launch, spec.resolved("cuda" if launch.backend == "nccl" else "cpu"), schedule


def print_result(result: dict) -> None:
    for step, loss in enumerate(result["losses"]):
        print(f"step {step} loss {loss!r}")
    print("median ms:", ", ".join(f"{name} {statistics.median(seconds) * 1e3:.3f}"
                                  for name, seconds in result["seconds"].items()))


if __name__ == "__main__":
    main()
    # A rank whose work is done and whose group is torn down leaves without the interpreter's teardown: there,
    # about one launch in 50 on a 2-core CPU, a thread of torch's C++ side still joinable when it is destroyed
    # aborted the rank ("terminate called without an active exception", no Python frame on any thread), and
    # torchrun reported a job that had trained and saved its parameters as failed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
