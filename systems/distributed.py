"""Process groups for data-parallel work: spawn N ranks here, or join the group torchrun started.

`launch(fn, world_size)` runs `fn(*args)` on every rank of a fresh process group (gloo on CPUs,
NCCL with one GPU per rank) and returns the ranks' return values in rank order. It never hangs
and never leaves a process behind: a rank that raises fails the call with its traceback, a rank
that does not finish in time has its stack dumped to stderr and is killed, and every process is
reaped before `launch` returns or raises. Code that runs inside `launch` also runs under torchrun
after `init_from_env(backend)`, so the same training code goes to several nodes unchanged.
"""

from __future__ import annotations

import ctypes
import faulthandler
import multiprocessing
import os
import pickle
import queue
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")


class RankFailed(RuntimeError):
    """A rank raised, or died without reporting; the message names it and carries its traceback."""


class RankTimeout(TimeoutError):
    """Ranks did not finish within the timeout and were killed; the message names them."""


def launch(fn: Callable, world_size: int, *, backend: str = "gloo", timeout: float = 120.0,
           args: tuple = ()) -> list:
    """Run `fn(*args)` on `world_size` spawned ranks and return their results, rank 0 first.

    `fn` and `args` must pickle (a module-level function); results must pickle too and should
    be CPU tensors or plain values. `timeout` (seconds) bounds everything: start-up, rendezvous,
    every collective and `fn` itself.
    """
    _check_group(world_size, backend, timeout)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    # A FileStore on a fresh path: concurrent launches (pytest-xdist workers) cannot collide.
    store_dir = tempfile.mkdtemp(prefix="systems-launch-")
    store_path = os.path.join(store_dir, "store")
    deadline = time.monotonic() + timeout
    ranks = [context.Process(target=_run_rank, name=f"rank {rank}",
                             args=(rank, world_size, backend, store_path, timeout, fn, args, results))
             for rank in range(world_size)]
    finished = False
    try:
        for process in ranks:
            process.start()
        outcomes = _collect(ranks, results, deadline, timeout)
        finished = True
        return outcomes
    finally:
        # Ranks that reported are only tearing down their group; failed or hung ones go at once.
        _reap(ranks, grace=30.0 if finished else 0.0)
        results.close()
        results.cancel_join_thread()
        shutil.rmtree(store_dir, ignore_errors=True)


def init_from_env(backend: str, timeout: float = 600.0) -> None:
    """Join the process group that torchrun describes in the environment (env:// rendezvous)."""
    _check_backend(backend)
    _init_group(backend, int(os.environ["LOCAL_RANK"]), timeout)


def rank_device() -> torch.device:
    """The device this rank computes on: its own GPU under NCCL, the CPU under gloo."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose from {BACKENDS}")


def _check_group(world_size: int, backend: str, timeout: float) -> None:
    _check_backend(backend)
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    if backend == "nccl" and world_size > torch.cuda.device_count():
        raise ValueError(f"nccl needs one GPU per rank: {world_size} ranks, {torch.cuda.device_count()} GPUs")


def _init_group(backend: str, local_rank: int, timeout: float, **rendezvous) -> None:
    device_id = None
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device_id = torch.device("cuda", local_rank)
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout), device_id=device_id, **rendezvous)


def _run_rank(rank, world_size, backend, store_path, timeout, fn, args, results) -> None:
    """The body of one spawned rank: join the group, run `fn`, report the result or the traceback."""
    _die_with_parent()
    faulthandler.register(signal.SIGUSR1)  # the parent asks a hung rank where it is stuck
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast stays off on the lent machines
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # all ranks live on this host
    if backend == "gloo":
        # N ranks share this machine's cores; torchrun does the same with OMP_NUM_THREADS.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        store = dist.FileStore(store_path, world_size)
        _init_group(backend, rank, timeout, store=store, rank=rank, world_size=world_size)
        outcome = ("ok", pickle.dumps(fn(*args)))
    except BaseException:
        outcome = ("error", traceback.format_exc())
    results.put((rank, *outcome))
    if dist.is_initialized():
        dist.destroy_process_group()


def _die_with_parent() -> None:
    """Have the kernel kill this rank if the parent dies, so not even a killed parent leaves orphans."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def _collect(ranks, results, deadline: float, timeout: float) -> list:
    outcomes = {}
    while len(outcomes) < len(ranks):
        try:
            outcomes.update(_as_outcome(results.get(timeout=max(0.0, min(0.2, deadline - time.monotonic())))))
        except queue.Empty:
            _check_progress(ranks, outcomes, results, deadline, timeout)
    return [outcomes[rank] for rank in range(len(ranks))]


def _check_progress(ranks, outcomes, results, deadline: float, timeout: float) -> None:
    """Fail on a rank that died without reporting, or on ranks still running at the deadline."""
    for rank, process in enumerate(ranks):
        if rank not in outcomes and process.exitcode is not None:
            try:  # its report may still be in flight
                outcomes.update(_as_outcome(results.get(timeout=1.0)))
            except queue.Empty:
                pass
            if rank not in outcomes:
                raise RankFailed(f"rank {rank} exited with code {process.exitcode} without reporting a result")
    if time.monotonic() >= deadline:
        hung = [rank for rank in range(len(ranks)) if rank not in outcomes]
        for rank in hung:
            if ranks[rank].is_alive():
                os.kill(ranks[rank].pid, signal.SIGUSR1)
        time.sleep(0.5)  # let faulthandler write their stacks to stderr
        names = ", ".join(f"rank {rank}" for rank in hung)
        raise RankTimeout(f"did not finish within {timeout:g} s and were killed (stacks on stderr): {names}")


def _as_outcome(item) -> dict:
    rank, status, payload = item
    if status == "error":
        raise RankFailed(f"rank {rank} failed:\n{payload}")
    return {rank: pickle.loads(payload)}


def _reap(ranks, grace: float) -> None:
    """Give the ranks `grace` seconds to exit, then terminate, then kill; join every one."""
    started = [process for process in ranks if process.pid is not None]
    deadline = time.monotonic() + grace
    for process in started:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in started:
        if process.is_alive():
            process.terminate()
    for process in started:
        process.join(timeout=5.0)
        if process.is_alive():
            process.kill()
            process.join()
