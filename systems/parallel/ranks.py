"""Process groups for data-parallel work: start N ranks here, or join the group torchrun started.

`launch(fn, world_size)` runs `fn(*args)` on every rank of a fresh process group (gloo on CPUs,
NCCL with one GPU per rank) and returns the ranks' return values in rank order. `RankPool` keeps
such a group alive to run one function after another, so a benchmark grid pays for starting ranks
and rendezvous once; ranks fork from a server that imported torch and Dynamo once (`_rank_context`). Neither
ever hangs or leaves a process behind: a rank that raises fails the call with its traceback, ranks
that do not finish in time have their stacks dumped to stderr and are killed, and after a failure
every process is reaped before the error reaches the caller.
Code that runs inside them also runs under torchrun after `init_from_env(backend)`, so the same
training code goes to several nodes unchanged.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import gc
import math
import multiprocessing
import os
import pickle
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from multiprocessing import reduction

import torch
import torch.distributed as dist

GROUP_BACKENDS = ("gloo", "nccl")
REPORT_GRACE = 1.0  # seconds; see _collect


class RankFailed(RuntimeError):
    """A rank raised, or died without reporting; the message names it and carries its traceback."""


class RankOutOfMemory(RankFailed, torch.OutOfMemoryError):
    """A rank ran out of GPU memory: caught like the OutOfMemoryError of single-process code."""


class RankTimeout(TimeoutError):
    """Ranks did not finish within the timeout and were killed; the message names them."""


class RankPool:
    """`world_size` spawned ranks of one process group, running one function after another.

    `timeout` (seconds) bounds each `run` from its call, start-up and rendezvous included for the
    first, and every collective. After a failure the pool is closed and `run` raises.
    """

    def __init__(self, world_size: int, *, backend: str = "gloo", timeout: float = 120.0):
        _check_group(world_size, backend, timeout)
        self.world_size, self.backend, self.timeout = world_size, backend, timeout
        context = _rank_context()
        self._jobs = [context.Queue() for _ in range(world_size)]
        self._results = context.Queue()
        # A FileStore on a fresh path: concurrent pools (pytest-xdist workers) cannot collide.
        self._store_dir = tempfile.mkdtemp(prefix="systems-ranks-")
        store_path = os.path.join(self._store_dir, "store")
        threads = max(1, torch.get_num_threads() // world_size)  # the ranks share this process's cores
        # The ranks' parent is the fork server, so each watches a pipe whose write end only this process holds:
        # it closes when this process ends, however it ends, and the ranks leave with it.
        lifeline, self._lifeline = os.pipe()
        self._ranks = [context.Process(target=_serve, name=f"rank {rank}",
                                       args=(rank, world_size, backend, store_path, timeout, threads,
                                             self._jobs[rank], self._results, dict(os.environ),
                                             _Inherited((1, 2, lifeline))))
                       for rank in range(world_size)]
        self.closed = False
        try:
            for process in self._ranks:
                process.start()
        except BaseException:
            self._shut_down(grace=0.0)
            raise
        finally:
            os.close(lifeline)

    def run(self, fn: Callable, *args, timeout: float | None = None) -> list:
        """`fn(*args)` on every rank; their results, rank 0 first.

        `fn` and `args` must pickle (a module-level function); results must pickle too and should
        be CPU tensors or plain values. `timeout` overrides the pool's for this call.
        """
        if self.closed:
            raise RuntimeError("this RankPool is closed")
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        job = pickle.dumps((fn, args))
        for jobs in self._jobs:
            jobs.put(job)
        try:
            return _collect(self._ranks, self._results, deadline, timeout)
        except BaseException:
            self._shut_down(grace=0.0)  # the other ranks may be stuck in a collective
            raise

    def close(self) -> None:
        """Let the ranks leave the group and exit; kill any that do not within 30 s."""
        if self.closed:
            return
        for jobs in self._jobs:
            jobs.put(None)
        self._shut_down(grace=30.0)

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _shut_down(self, grace: float) -> None:
        self.closed = True
        _reap(self._ranks, grace)
        os.close(self._lifeline)
        for channel in (*self._jobs, self._results):
            channel.close()
            channel.cancel_join_thread()
        shutil.rmtree(self._store_dir, ignore_errors=True)


def launch(fn: Callable, world_size: int, *, backend: str = "gloo", timeout: float = 120.0,
           args: tuple = ()) -> list:
    """Run `fn(*args)` once on `world_size` fresh ranks and return their results, rank 0 first."""
    with RankPool(world_size, backend=backend, timeout=timeout) as pool:
        return pool.run(fn, *args)


class RankPools:
    """A live RankPool per (world size, backend, visible GPUs), started on first use and again after a failure.

    A pool's ranks run on the GPUs this process let them see when it started them (under `pytest -n`, the GPUs
    an item leased): a run with other GPUs visible gets a pool of its own, and the others are closed first, so
    that no idle pool keeps memory on GPUs another process now uses."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._pools: dict[tuple[int, str, str | None], RankPool] = {}

    def run(self, world_size: int, backend: str, fn: Callable, *args, timeout: float | None = None) -> list:
        """`fn(*args)` on every rank of the pool for (world_size, backend); `timeout` overrides the pools'."""
        key = (world_size, backend, os.environ.get("CUDA_VISIBLE_DEVICES"))
        for other in [other for other in self._pools if other[2] != key[2]]:
            self._pools.pop(other).close()
        pool = self._pools.get(key)
        if pool is None or pool.closed:
            pool = self._pools[key] = RankPool(world_size, backend=backend, timeout=self.timeout)
        return pool.run(fn, *args, timeout=timeout)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()

    def __enter__(self) -> RankPools:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def init_from_env(backend: str, timeout: float = 600.0) -> None:
    """Join the process group that torchrun describes in the environment (env:// rendezvous), as a rank that dies
    with its launcher: torchrun starts each rank in a session of its own, so a launcher killed with its node's
    process group would otherwise leave its ranks running. `timeout` (seconds) bounds the rendezvous and every
    collective. A rank that crashes (an abort in a collective library, a segfault) writes its threads' Python
    stacks to stderr first."""
    _check_backend(backend)
    die_with_parent()
    faulthandler.enable()
    if backend == "nccl":
        _fail_on_dead_peers(timeout)
    _init_group(backend, int(os.environ["LOCAL_RANK"]), timeout)


def _fail_on_dead_peers(timeout: float) -> None:
    """Let NCCL's timeout end a rank whose peer died (a user's own settings win). The watchdog notices a
    collective's timeout but can stall preparing its debug dump, so the heartbeat monitor, which aborts a rank
    whose watchdog stalls, waits the timeout instead of its default minutes. NCCL's blocking set-up of a
    communicator (a subgroup's, or its connections, by default made at its first collective) waits for a dead
    peer outside the watchdog's view: communicators are set up without blocking, connections when the group
    starts. docs/multinode.md has the measurements."""
    os.environ.setdefault("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", str(math.ceil(timeout)))
    os.environ.setdefault("NCCL_RUNTIME_CONNECT", "0")
    os.environ.setdefault("TORCH_NCCL_USE_COMM_NONBLOCKING", "1")


def rank_device() -> torch.device:
    """The device this rank computes on: its own GPU under NCCL, the CPU under gloo."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_backend(backend: str) -> None:
    if backend not in GROUP_BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose from {GROUP_BACKENDS}")


def _check_group(world_size: int, backend: str, timeout: float) -> None:
    _check_backend(backend)
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    if backend == "nccl" and world_size > torch.cuda.device_count():
        raise ValueError(f"nccl needs one GPU per rank: {world_size} ranks, {torch.cuda.device_count()} GPUs")


def _init_group(backend: str, local_rank: int, timeout: float, **rendezvous) -> None:
    device_id = None
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device_id = torch.device("cuda", local_rank)
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout), device_id=device_id, **rendezvous)


def _rank_context():
    """Ranks fork from a server process that has imported torch and Dynamo once (multiprocessing's forkserver), so
    a pool starts in a fork rather than in fresh interpreters each importing them: seconds a rank on a small host
    (Dynamo loads at the first torch optimizer a rank builds, or FSDP). Neither import initializes a GPU: a forked
    child could not use one that was. A rank takes the environment and the standard output and error of the
    process that starts it, as a spawned one would (`_serve`, `_Inherited`), not the server's, and leaves when that
    process ends (`_exit_when_closed`)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch._dynamo"])
    return context


class _Inherited:
    """File descriptors of this process as they are when a rank starts (its standard output and error: pytest's
    capture of the test that starts it, say), handed to the rank."""

    def __init__(self, fds: tuple[int, ...]):
        self.fds = fds

    def __reduce__(self):
        return _Inherited.received, tuple(reduction.DupFd(fd) for fd in self.fds)

    @staticmethod
    def received(*fds) -> tuple[int, ...]:
        return tuple(fd.detach() for fd in fds)


def _serve(rank, world_size, backend, store_path, timeout, threads, jobs, results, environ, inherited) -> None:
    """The body of one rank: take its starter's environment and output, leave when its starter ends, join the
    group, then run jobs until told to stop."""
    gc.freeze()  # what the server loaded lives as long as the rank: the collection after each job passes it by
    os.environ.clear()
    os.environ.update(environ)
    out, err, lifeline = inherited
    for fd, received in ((1, out), (2, err)):
        os.dup2(received, fd)
        os.close(received)
    threading.Thread(target=_exit_when_closed, args=(lifeline,), name="lifeline", daemon=True).start()
    faulthandler.register(signal.SIGUSR1)  # the parent asks a hung rank where it is stuck
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast stays off on the lent machines
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # all ranks live on this host
    # The ranks share their parent's cores, as torchrun's OMP_NUM_THREADS does; so do their children and their
    # Inductor compile workers (else a pool of up to 32 processes each, on the first torch.compile).
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = str(threads)
    from torch._inductor import config  # came from the server with Dynamo, sized by the server's environment

    config.compile_threads = threads
    try:
        _init_group(backend, rank, timeout, store=dist.FileStore(store_path, world_size),
                    rank=rank, world_size=world_size)
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        return
    while (job := jobs.get()) is not None:
        try:
            with _as_a_fresh_rank():
                fn, args = pickle.loads(job)
                outcome = ("ok", pickle.dumps(fn(*args)))
        except torch.OutOfMemoryError:
            outcome = ("oom", traceback.format_exc())
        except BaseException:
            outcome = ("error", traceback.format_exc())
        results.put((rank, *outcome))
        gc.collect()  # the next job starts from an empty GPU
        torch.cuda.empty_cache()
    dist.destroy_process_group()


def _exit_when_closed(lifeline: int) -> None:
    """End this process the moment the pipe's write end closes: the process that started it has ended."""
    while os.read(lifeline, 1):
        pass
    os._exit(1)


@contextlib.contextmanager
def _as_a_fresh_rank():
    """A job's process-wide settings end with it (warning filters, deterministic algorithms, the default dtype, grad
    mode), so that the next job of a pool starts as it would on a fresh rank."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    dtype, grad = torch.get_default_dtype(), torch.is_grad_enabled()
    try:
        with warnings.catch_warnings():
            yield
    finally:
        # Only where the job changed it: the first call of use_deterministic_algorithms imports seconds of torch.
        if (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()) != (
                deterministic, warn_only):
            torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.set_default_dtype(dtype)
        torch.set_grad_enabled(grad)


def die_with_parent() -> None:
    """Have the kernel kill this rank when the thread that started it dies, so not even a killed parent
    leaves orphans."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def _collect(ranks, results, deadline: float, timeout: float) -> list:
    """The ranks' results in rank order, or the error of the rank that failed first.

    A failure is raised `REPORT_GRACE` seconds after it shows: long enough for a dead rank's last report
    to arrive, and for the death that a survivor's error follows from (a peer gone mid-collective
    breaks the survivor's connection) to show, so that the rank named is the one that failed.
    """
    outcomes, reported, died = {}, {}, {}
    while len(outcomes) < len(ranks):
        try:
            rank, status, payload = results.get(timeout=max(0.0, min(0.2, deadline - time.monotonic())))
            if status == "ok":
                outcomes[rank] = pickle.loads(payload)
            else:
                reported.setdefault(rank, (time.monotonic(), _rank_error(rank, status, payload)))
        except queue.Empty:
            pass
        for rank, process in enumerate(ranks):
            if rank not in outcomes and rank not in reported and process.exitcode is not None:
                died.setdefault(rank, time.monotonic())
        _raise_failure(ranks, outcomes, reported, died)
        _raise_at_deadline(ranks, outcomes, deadline, timeout)
    return [outcomes[rank] for rank in range(len(ranks))]


def _rank_error(rank: int, status: str, payload: str) -> RankFailed:
    error = RankOutOfMemory if status == "oom" else RankFailed
    return error(f"rank {rank} failed: {payload.strip().splitlines()[-1]}\n{payload}")


def _raise_failure(ranks, outcomes: dict, reported: dict, died: dict) -> None:
    """Once the first sign of a failure is `REPORT_GRACE` seconds old, raise for the first rank that died
    without reporting (a survivor's error may follow from it), or else for the first error reported."""
    dead = [rank for rank in sorted(died, key=died.get) if rank not in outcomes and rank not in reported]
    signs = [seen for seen, _ in reported.values()] + [died[rank] for rank in dead]
    if not signs or time.monotonic() - min(signs) < REPORT_GRACE:
        return
    first_error = min(reported.values(), key=lambda sign: sign[0], default=(None, None))[1]
    if dead:
        message = f"rank {dead[0]} {_death(ranks[dead[0]].exitcode)} without reporting a result"
        raise RankFailed(message) from first_error
    raise first_error


def _death(exitcode: int) -> str:
    if exitcode < 0:
        return f"was killed by {signal.Signals(-exitcode).name}"
    return f"exited with code {exitcode}"


def _raise_at_deadline(ranks, outcomes: dict, deadline: float, timeout: float) -> None:
    if time.monotonic() < deadline:
        return
    hung = [rank for rank in range(len(ranks)) if rank not in outcomes]
    for rank in hung:
        if ranks[rank].is_alive():
            os.kill(ranks[rank].pid, signal.SIGUSR1)
    time.sleep(0.5)  # let faulthandler write their stacks to stderr
    names = ", ".join(f"rank {rank}" for rank in hung)
    raise RankTimeout(f"did not finish within {timeout:g} s and were killed (stacks on stderr): {names}")


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
