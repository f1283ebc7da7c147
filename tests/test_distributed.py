"""The process-group harness: results come back, faults fail fast and name the rank, nothing outlives
a call; and the data-parallel training entry point runs under torchrun like one process would, and
trains bf16 weights through fp32 master copies."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from systems.accounting import count_parameters
from systems.parallel.spec import Schedule, TrainSpec
from systems.parallel.train import PHASES, train
from systems.parallel.ranks import (RankFailed, RankPool, RankPools, RankTimeout, _rank_context, launch,
                                    rank_device)
from systems.model import get_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
HANG_TIMEOUT = 2.0  # seconds a call with a hung rank waits: ample for the other rank of a started pool to finish
# A dead rank must fail the call long before this deadline: the harness waits its 1 s REPORT_GRACE, then
# up to 5 s for the survivors to take SIGTERM; 30 s leaves room for a loaded 2-core machine.
DEATH_TIMEOUT, PROMPT = 300.0, 30.0


def sum_of_ranks(scale: float) -> tuple[int, float, int]:
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    return dist.get_rank(), scale * total.item(), dist.get_world_size()


def rank_and_pid() -> tuple[int, int]:
    return dist.get_rank(), os.getpid()


def misbehave(fault: str, rank_0_waits: bool, pid_dir: str) -> str:
    """Rank 1 commits `fault`; rank 0 returns, or waits for rank 1 in an all-reduce. Each rank leaves its
    pid behind."""
    pathlib.Path(pid_dir, str(dist.get_rank())).write_text(str(os.getpid()))
    if dist.get_rank() == 1:
        if fault == "raise":
            raise ValueError("bad input on rank 1")
        if fault == "exit":
            os._exit(3)
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(3600)
    if rank_0_waits:
        dist.all_reduce(torch.ones(3, device=rank_device()))
    return "done"


@pytest.mark.parametrize("fault, rank_0_waits, timeout, error, message", [
    ("raise", True, DEATH_TIMEOUT, RankFailed, r"(?s)rank 1 failed: ValueError: bad input on rank 1\n.*Traceback"),
    ("exit", False, DEATH_TIMEOUT, RankFailed, "rank 1 exited with code 3 without reporting"),
    ("exit", True, DEATH_TIMEOUT, RankFailed, "rank 1 exited with code 3 without reporting"),
    ("kill", True, DEATH_TIMEOUT, RankFailed, "rank 1 was killed by SIGKILL without reporting"),
    ("hang", False, HANG_TIMEOUT, RankTimeout, f"did not finish within {HANG_TIMEOUT:g} s .*: rank 1$"),
], ids=["raise", "exit", "exit-in-all-reduce", "kill-in-all-reduce", "hang"])
@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.multigpu(2))])
def test_a_faulty_rank_fails_the_call_promptly_by_name_and_leaves_no_process(tmp_path, backend, fault, rank_0_waits,
                                                                              timeout, error, message):
    """A rank that raises or dies fails the call long before its deadline, naming that rank, also where rank 0
    waits for it in an all-reduce (there gloo fails rank 0 too, and NCCL hangs it); a hung rank fails the call at
    its deadline."""
    with RankPool(2, backend=backend, timeout=DEATH_TIMEOUT) as pool:
        pool.run(rank_and_pid)  # started up: from here on only the fault can be slow
        start = time.monotonic()
        with pytest.raises(error, match=message) as raised:
            pool.run(misbehave, fault, rank_0_waits, str(tmp_path), timeout=timeout)
        assert time.monotonic() - start < (HANG_TIMEOUT + 5 if fault == "hang" else PROMPT)
        pids = [int(path.read_text()) for path in tmp_path.iterdir()]
        assert len(pids) == 2
        for pid in pids:  # the failed call itself killed and reaped every rank, not the pool's close
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    assert "rank 0" not in str(raised.value)


def own_a_pool(channel) -> None:
    """A pool's owner: it starts one, sends its ranks' pids down `channel` and waits to be killed."""
    pool = RankPool(2)
    channel.send([pid for _, pid in pool.run(rank_and_pid)])
    time.sleep(600)


def test_a_killed_pools_owner_leaves_no_rank_behind():
    """The ranks' parent is the fork server, which outlives a killed owner: they must leave by themselves. The owner
    forks from this process's fork server, as a rank does (torch loaded), and starts a fork server of its own."""
    context = _rank_context()
    received, sent = context.Pipe(duplex=False)
    owner = context.Process(target=own_a_pool, args=(sent,))
    owner.start()
    try:
        assert received.poll(PROMPT), "the owner sent no pids"
        pids = received.recv()
    finally:
        owner.kill()
        owner.join()
    assert len(pids) == 2
    deadline = time.monotonic() + PROMPT
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    orphans = [pid for pid in pids if _alive(pid)]
    for pid in orphans:
        os.kill(pid, signal.SIGKILL)
    assert not orphans


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def speak() -> str:
    print(f"rank {dist.get_rank()} to stdout", flush=True)
    print(f"rank {dist.get_rank()} to stderr", file=sys.stderr, flush=True)
    return os.environ.get("SYSTEMS_LAB_PROBE")


def test_ranks_take_their_starters_environment_and_output(capfd, monkeypatch):
    """Ranks fork from a server started once; what they see is the starter's now: the environment it has when a
    pool starts, and its standard output and error (here this test's capture), not the server's."""
    with capfd.disabled():
        launch(rank_and_pid, 1)  # the server, if not yet running, starts outside this test's capture
    monkeypatch.setenv("SYSTEMS_LAB_PROBE", "set after the server started")
    assert launch(speak, 2) == ["set after the server started"] * 2
    out, err = capfd.readouterr()
    assert sorted(out.splitlines()) == ["rank 0 to stdout", "rank 1 to stdout"]
    assert {"rank 0 to stderr", "rank 1 to stderr"} <= set(err.splitlines())


def change_process_settings() -> None:
    warnings.simplefilter("error")
    torch.use_deterministic_algorithms(True)
    torch.set_default_dtype(torch.float64)


def process_settings() -> tuple:
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn("a warning")
    return len(caught), torch.are_deterministic_algorithms_enabled(), torch.get_default_dtype()


def test_pools_run_jobs_in_the_same_ranks_and_start_afresh_after_a_failure(tmp_path):
    """A pool's jobs share its ranks, but not the process-wide settings a job changes."""
    with RankPools(timeout=120) as pools:
        first = pools.run(2, "gloo", rank_and_pid)
        assert pools.run(2, "gloo", sum_of_ranks, 10.0) == [(0, 30.0, 2), (1, 30.0, 2)]
        fresh_settings = pools.run(2, "gloo", process_settings)
        pools.run(2, "gloo", change_process_settings)
        assert pools.run(2, "gloo", process_settings) == fresh_settings == [(1, False, torch.float32)] * 2
        assert pools.run(2, "gloo", rank_and_pid) == first
        with pytest.raises(RankFailed, match="rank 1 failed: ValueError: bad input on rank 1"):
            pools.run(2, "gloo", misbehave, "raise", False, str(tmp_path))
        for _, pid in first:  # the failed pool is gone ...
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        fresh = pools.run(2, "gloo", rank_and_pid)  # ... and the next job gets a new one
    assert [rank for rank, _ in first] == [rank for rank, _ in fresh] == [0, 1]
    assert {pid for _, pid in first}.isdisjoint(pid for _, pid in fresh)


@pytest.mark.parametrize("bad", [
    dict(world_size=0), dict(world_size=2, backend="mpi"), dict(world_size=2, timeout=0),
    dict(world_size=torch.cuda.device_count() + 1, backend="nccl"),
])
def test_launch_rejects_bad_arguments(bad):
    with pytest.raises(ValueError):
        launch(sum_of_ranks, **bad, args=(1.0,))


@pytest.mark.launch
def test_training_under_torchrun_matches_one_process():
    """Two ranks on halves of each batch reach the losses of one process on the whole batch (both under
    torchrun on gloo, so both on the CPU, also where a GPU is present). In the launch tier: the default tier
    launches the same entry point under torchrun as two nodes (tests/test_multinode.py), exact against one
    process, and trains the bucketed DDP against one process in spawned ranks (tests/test_ddp.py)."""
    spec = dict(preset="tiny", variant="bucketed", bucket_size_mb=1.0, batch_size=2, context=32, warmup=0, steps=3)
    two_ranks = torchrun_losses(2, spec)
    one_process = torchrun_losses(1, spec | dict(variant="single", batch_size=4))
    assert len(two_ranks) == 3
    torch.testing.assert_close(torch.tensor(two_ranks), torch.tensor(one_process), rtol=1e-5, atol=0)


def torchrun_losses(ranks: int, spec: dict) -> list[float]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               "-m", "systems.parallel", "--backend", "gloo"]
    command += [f"--{key.replace('_', '-')}={value}" for key, value in spec.items()]
    env = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    return [float(line.split()[-1]) for line in out.stdout.splitlines() if line.startswith("step ")]


@pytest.mark.parametrize("precision, bytes_per_parameter", [("fp32", 8), ("bf16-weights", 12)])
def test_training_keeps_an_fp32_master_copy_of_bf16_weights(precision, bytes_per_parameter):
    """AdamW's state is two fp32 moments per parameter, and for a bf16 weight an fp32 master copy too."""
    spec = TrainSpec(preset="tiny", variant="single", precision=precision, batch_size=1, context=8)
    state_bytes = train(spec, Schedule(warmup=0, steps=1))["state_bytes"]
    assert state_bytes == bytes_per_parameter * count_parameters(get_config("tiny"))


def test_training_times_every_phase_of_each_timed_step():
    """Warm-up steps are trained but not timed; a step's time is the sum of its phases."""
    schedule = Schedule(warmup=1, steps=3)
    result = train(TrainSpec(preset="tiny", variant="single", batch_size=1, context=8), schedule)
    seconds = result["seconds"]
    assert len(result["losses"]) == schedule.warmup + schedule.steps
    assert list(seconds) == [*PHASES, "step"]
    assert all(len(values) == schedule.steps and min(values) >= 0 for values in seconds.values())
    torch.testing.assert_close(seconds["step"], [sum(phases) for phases in zip(*(seconds[p] for p in PHASES))])


def test_training_without_a_process_group_is_single_process_only():
    with pytest.raises(ValueError, match="variant 'bucketed' needs a process group"):
        train(TrainSpec(preset="tiny", variant="bucketed"))
