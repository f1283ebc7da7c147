"""Several nodes: `python -m systems.parallel` started as two nodes of two ranks each, one torchrun per node
meeting through the c10d rendezvous on 127.0.0.1 (docs/multinode.md), trains like one process, and a node that
dies or never arrives fails the job within a bound the test sets, leaving no process behind.

Training: every variant, ours (the DDP variants, FSDP, HSDP 2 x 2) and torch's (DDP, FSDP2, HSDP 2 x 2), trains 3
steps on gloo; rank 0 prints the losses and saves the trained parameters, gathered whole (`--save-params`).
- Where the reduction order allows (our FSDP and HSDP sum in rank order under gloo; torch's HSDP at 2 x 2 sums
  two terms per group, exact in binary: tests/test_hsdp.py), losses and parameters equal, bit for bit, one
  process that averages the ranks' micro-batch gradients in that order (tests/layout_reference.py).
- Elsewhere (gloo's ring all-reduce sums each chunk from another rank) they equal, bit for bit, the same four
  ranks trained by `train(spec)` on one node (spawned, one thread each as the launched ranks), and the losses
  equal one process's on the whole batch within the rounding of the sums on the way (LOSS_RTOL).
A node's ranks taking another node's rows (a local rank used as the rank) or seeds changes both far beyond any
rounding. The same runs of hsdp and torch-hsdp under NCCL (4 GPUs as 2 nodes x 2, each node's launcher seeing its
own two GPUs) compare their losses with one process within LOSS_RTOL (cuBLAS and NCCL sum in their own orders).

Failures: the launchers get a rendezvous join timeout (JOIN_TIMEOUT), and the ranks a process-group timeout
(GROUP_TIMEOUT) that bounds any collective a dead peer leaves waiting. A node killed mid-run (its launcher's
whole process group, as a node's power going would) fails the surviving launcher within GROUP_TIMEOUT plus
start-up slack, naming rank and node (test_a_node_that_dies... says how); a node that never arrives fails the
rendezvous within its join timeout (NEVER_ARRIVES) plus slack. Nothing is left behind: every process the test
starts carries a marker in its environment, and /proc must hold none of them afterwards (the ranks torchrun starts
live in sessions of their own; ours die with their launcher, systems.parallel.ranks.init_from_env). Teardown kills
any that remain.
Ports are free ports the kernel picks and rendezvous ids are fresh, so `pytest -n` workers cannot collide.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from layout_reference import assert_trained_alike, train_one_process
from systems.bench.leases import visible_gpus
from systems.levers.layout import Layout
from systems.model import get_config
from systems.parallel.parallelize import full_parameters
from systems.parallel.ranks import RankPool, _fail_on_dead_peers
from systems.parallel.spec import Schedule, TrainSpec
from systems.parallel.train import train

ROOT = Path(__file__).resolve().parents[1]
MARKER = "SYSTEMS_LAB_MULTINODE_TEST"
NODES, RANKS_PER_NODE = 2, 2
WORLD_SIZE = NODES * RANKS_PER_NODE
# Seconds. The rendezvous waits JOIN_TIMEOUT for every node: where both come, long enough for the second to start
# on a loaded machine; where one never comes, the bound under test (NEVER_ARRIVES). A collective waits GROUP_TIMEOUT.
JOIN_TIMEOUT, NEVER_ARRIVES, GROUP_TIMEOUT = 120, 1, 20
START_SLACK = 30  # seconds for six Python processes to import torch on a loaded 2-core machine
RUN_TIMEOUT = 240

BASE = TrainSpec(preset="tiny", variant="hsdp", layout="2x2", precision="fp32", batch_size=2, context=16, lr=1e-2)
SCHEDULE = Schedule(warmup=0, steps=3)
# name: (spec, exact against the one-process reference). Each costs a launch of six Python processes (~10 s on 2
# cores): our HSDP runs by default, the others in the launch tier. What several nodes change is where a rank's
# place comes from (torchrun's environment, read by the entry point and init_from_env, which every variant shares);
# each variant's arithmetic is checked against one process in spawned ranks in its own test file, torch's HSDP at
# 2 x 2 through `train` in tests/test_train_layouts.py, bit for bit.
VARIANTS = {
    "hsdp-2x2": (BASE, True),
    "torch-hsdp-2x2": (dataclasses.replace(BASE, variant="torch-hsdp"), True),
    "bucketed": (dataclasses.replace(BASE, variant="bucketed", layout=None, bucket_size_mb=1.0), False),
    "fsdp": (dataclasses.replace(BASE, variant="fsdp", layout=None), True),
    "naive": (dataclasses.replace(BASE, variant="naive", layout=None), False),
    "flat": (dataclasses.replace(BASE, variant="flat", layout=None), False),
    "individual": (dataclasses.replace(BASE, variant="individual", layout=None), False),
    "torch": (dataclasses.replace(BASE, variant="torch", layout=None, bucket_size_mb=1.0), False),
    "fsdp2": (dataclasses.replace(BASE, variant="fsdp2", layout=None), False),
}
QUICK = ("hsdp-2x2",)
NCCL_VARIANTS = ("hsdp-2x2", "torch-hsdp-2x2")
# One process and the ranks compute the same sums grouped otherwise. Two orders of a sum of K fp32 terms differ by
# at most 2 K u of the terms' magnitudes (Higham's gamma_K, u = 2^-24). On the way to a loss: the mean over the
# batch's tokens (K = 4 ranks x 2 rows x 16 tokens = 128) and, per block, four matmuls (qkv, out, the SwiGLU's
# w1/w3 and w2) whose longest sums are d_ff = 256 long: 2 x (128 + 2 blocks x 4 x 256) u = 1.6e-4 of the loss.
# The weights a later step's loss sees differ by the updates' rounding, whose effect on the loss is second order
# (AdamW's update of an element whose gradient sum changes sign is lr times a gradient ~2 K u small).
_CONFIG = get_config("tiny")
LOSS_RTOL = 2 * (WORLD_SIZE * BASE.batch_size * BASE.context + _CONFIG.num_layers * 4 * _CONFIG.d_ff) * 2.0**-24


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def spec_options(spec: TrainSpec, schedule: Schedule = SCHEDULE) -> list[str]:
    """The entry point's options for `spec` and `schedule`, one per field, as text its parsers read back."""
    options = []
    for levers in (spec, schedule):
        for field in dataclasses.fields(levers):
            value = getattr(levers, field.name)
            if value is not None and value != field.default:
                text = value.name if field.name == "precision" else value
                options.append(f"--{field.name.replace('_', '-')}={text}")
    return options


@dataclasses.dataclass
class Node:
    process: subprocess.Popen
    stdout: Path
    stderr: Path

    def output(self) -> str:
        return self.stdout.read_text() + self.stderr.read_text()


class Cluster:
    """Launchers of one job, each in a session of its own, every process carrying the job's marker."""

    def __init__(self, folder: Path, backend: str, join_timeout: float = JOIN_TIMEOUT):
        self.folder, self.backend, self.join_timeout = folder, backend, join_timeout
        self.port, self.job = free_port(), uuid.uuid4().hex
        self.nodes: list[Node] = []

    def start(self, options: list[str], gpus: list[str] | None = None, host_first: bool = True) -> Node:
        """One node's launcher: `torchrun --nnodes 2 --nproc-per-node 2` on the job's rendezvous. The launcher that
        binds the endpoint's port first hosts the rendezvous' store, and the others connect to it; with
        `host_first`, that is the first one started: it is listening before the next starts."""
        if self.nodes and host_first:
            deadline = time.monotonic() + START_SLACK
            while not listening(self.port) and self.nodes[0].process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
        command = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={NODES}",
                   f"--nproc-per-node={RANKS_PER_NODE}", "--rdzv-backend=c10d",
                   f"--rdzv-endpoint=127.0.0.1:{self.port}", f"--rdzv-id={self.job}",
                   f"--rdzv-conf=join_timeout={self.join_timeout:g}", "--max-restarts=0",
                   "--monitor-interval=0.1", "-m", "systems.parallel", f"--backend={self.backend}",
                   f"--timeout={GROUP_TIMEOUT}", *options]
        # One thread, MKL's too (it reads its own variable): the one-process reference sums in that order.
        env = os.environ | {MARKER: self.job, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                            "GLOO_SOCKET_IFNAME": "lo", "NCCL_NVLS_ENABLE": "0",
                            "CUDA_VISIBLE_DEVICES": ",".join(gpus or []),
                            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        index = len(self.nodes)
        stdout, stderr = self.folder / f"node{index}.out", self.folder / f"node{index}.err"
        with open(stdout, "w") as out, open(stderr, "w") as err:
            process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=err, start_new_session=True)
        self.nodes.append(Node(process, stdout, stderr))
        return self.nodes[-1]

    def wait(self, node: Node, timeout: float) -> int:
        try:
            return node.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the launcher did not exit within {timeout:g} s:\n{node.output()[-3000:]}")

    def wait_all(self, timeout: float) -> list[int | None]:
        """The launchers' exit codes once all have exited, or as soon as one has failed: a launcher whose ranks
        succeeded waits out torchrun's exit barrier (5 minutes) for a node that failed."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            codes = [node.process.poll() for node in self.nodes]
            if None not in codes or any(codes):
                return codes
            time.sleep(0.2)
        pytest.fail(f"the launchers did not exit within {timeout:g} s:\n{self.output()[-5000:]}")

    def output(self) -> str:
        return "\n".join(node.output() for node in self.nodes)

    def processes(self) -> list[int]:
        """Every live process that carries the job's marker."""
        entry = f"{MARKER}={self.job}".encode()
        pids = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                environ = Path("/proc", pid, "environ").read_bytes()
                state = Path("/proc", pid, "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:  # gone, or another user's
                continue
            if entry in environ.split(b"\0") and state != "Z":
                pids.append(int(pid))
        return pids

    def assert_nothing_left(self, grace: float = 10.0) -> None:
        """No process of the job lives `grace` seconds on (a rank dies with its launcher a moment after it)."""
        deadline = time.monotonic() + grace
        while (left := self.processes()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, f"processes left behind: {left}"

    def kill_all(self) -> None:
        for node in self.nodes:
            if node.process.poll() is None:
                os.killpg(node.process.pid, signal.SIGKILL)
                node.process.wait()
        for pid in self.processes():
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def cluster_of(tmp_path):
    clusters = []

    def make(backend: str, **timeouts) -> Cluster:
        clusters.append(Cluster(tmp_path, backend, **timeouts))
        return clusters[-1]

    yield make
    for cluster in clusters:
        cluster.kill_all()


def gpus_of(backend: str, node: int) -> list[str] | None:
    """The GPUs node `node`'s launcher sees: its two of the four this test holds (none under gloo)."""
    if backend == "gloo":
        return None
    return visible_gpus()[node * RANKS_PER_NODE:(node + 1) * RANKS_PER_NODE]


def losses_printed(output: str) -> list[float]:
    return [float(loss) for loss in re.findall(r"^step \d+ loss (\S+)$", output, re.MULTILINE)]


def run_two_nodes(cluster: Cluster, spec: TrainSpec, params_file: Path, gpus: list[list[str]] | None = None) -> dict:
    options = spec_options(spec) + [f"--save-params={params_file}"]
    for node in range(NODES):  # at once: which launcher hosts the store changes nothing here
        cluster.start(options, gpus[node] if gpus else None, host_first=False)
    codes = cluster.wait_all(RUN_TIMEOUT)
    assert codes == [0] * NODES, cluster.output()[-5000:]
    cluster.assert_nothing_left()
    output = cluster.output()
    assert f"{WORLD_SIZE} ranks on {NODES} node(s), {spec.variant} over {spec.layout_for(WORLD_SIZE)}" in output
    return {"losses": losses_printed(output), "params": torch.load(params_file)}


@contextlib.contextmanager
def one_thread():
    """As the launched ranks compute: a CPU kernel may split its sums between threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def one_process(spec: TrainSpec, device: torch.device) -> dict:
    """One process on the whole batch: every rank's rows at once."""
    whole = dataclasses.replace(spec, variant="single", layout=None, batch_size=WORLD_SIZE * spec.batch_size)
    with one_thread():
        return train_one_process(whole, SCHEDULE, Layout(), device)


def train_on_one_node(spec: TrainSpec) -> dict:
    torch.set_num_threads(1)  # as the launched ranks
    return train(spec, SCHEDULE, lambda model, step: {"params": full_parameters(model)})


@pytest.fixture(scope="module")
def one_node():
    with RankPool(WORLD_SIZE, backend="gloo", timeout=RUN_TIMEOUT) as pool:
        yield pool


@pytest.mark.parametrize("name", [name if name in QUICK else pytest.param(name, marks=pytest.mark.launch)
                                  for name in VARIANTS])
def test_two_nodes_train_like_one_process(cluster_of, tmp_path, request, name):
    spec, exact = VARIANTS[name]
    result = run_two_nodes(cluster_of("gloo"), spec, tmp_path / "params.pt")
    assert len(result["losses"]) == SCHEDULE.steps
    cpu = torch.device("cpu")
    if exact:
        with one_thread():
            expected = train_one_process(spec, SCHEDULE, spec.layout_for(WORLD_SIZE), cpu)
    else:
        expected = request.getfixturevalue("one_node").run(train_on_one_node, spec)[0]
    assert_trained_alike(result, expected)
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(one_process(spec, cpu)["losses"]),
                               rtol=LOSS_RTOL, atol=0)


@pytest.mark.multigpu(WORLD_SIZE)
@pytest.mark.parametrize("name", NCCL_VARIANTS)
def test_two_nodes_of_two_gpus_train_like_one_process(cluster_of, tmp_path, name):
    spec, _ = VARIANTS[name]
    per_node = [gpus_of("nccl", node) for node in range(NODES)]
    result = run_two_nodes(cluster_of("nccl"), spec, tmp_path / "params.pt", per_node)
    expected = one_process(spec, torch.device("cuda"))
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(expected["losses"]), rtol=LOSS_RTOL,
                               atol=0)


FAILURE_LINE = re.compile(r"python -m systems\.parallel: rank (\d) of 4 \(node (\d) of 2, local rank (\d), host .*\) "
                          r"failed: (.*)")
BACKENDS = ["gloo", pytest.param("nccl", marks=pytest.mark.multigpu(WORLD_SIZE))]


@pytest.mark.parametrize("victim", [1, pytest.param(0, marks=pytest.mark.launch)], ids=["joined-second", "store-host"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_node_that_dies_mid_run_fails_the_job_promptly_naming_rank_and_node(cluster_of, backend, victim):
    """Node `victim` (1: the one that joined second; 0: the one whose launcher hosts the rendezvous' store) is
    killed, launcher and ranks, a moment into a long run; the other's launcher fails within the process-group
    timeout plus slack, and nothing is left. Where the second node died, the survivor's ranks fail in their next
    collective and each names itself and its node; where the store's host died, the survivor's launcher
    fails on its next look at the rendezvous (every tenth of a second) and says it lost the store, its ranks
    stopped with it, named only if they failed first."""
    cluster = cluster_of(backend)
    long_run = spec_options(BASE, Schedule(warmup=0, steps=100_000))
    nodes = [cluster.start(long_run, gpus_of(backend, node)) for node in range(NODES)]
    deadline = time.monotonic() + 2 * START_SLACK
    while "ranks on 2 node(s)" not in cluster.output():
        assert time.monotonic() < deadline and all(n.process.poll() is None for n in nodes), cluster.output()
        time.sleep(0.2)
    time.sleep(2.0)  # into the training steps
    assert all(node.process.poll() is None for node in nodes), cluster.output()
    killed_at = time.monotonic()
    os.killpg(nodes[victim].process.pid, signal.SIGKILL)
    survivor = nodes[1 - victim]
    code = cluster.wait(survivor, GROUP_TIMEOUT + START_SLACK)
    assert time.monotonic() - killed_at < GROUP_TIMEOUT + START_SLACK
    assert code != 0
    cluster.assert_nothing_left()
    output = survivor.output()
    failures = FAILURE_LINE.findall(output)
    # A rank that names itself is the survivor's, with its node: ranks 2g and 2g + 1 on node g.
    assert all(int(rank) == RANKS_PER_NODE * int(node) + int(local) for rank, node, local, _ in failures)
    assert len({node for _, node, _, _ in failures}) <= 1
    if victim == 0:  # the survivor's launcher loses the rendezvous' store and stops its ranks: it says so
        assert "The connection to the C10d store has failed" in output, output[-3000:]
    elif backend == "gloo":  # its ranks see their peers' connections close and name themselves; torchrun stops
        # a node's other ranks once one has failed, so on a loaded host the second may be stopped before it can
        assert failures and {int(local) for _, _, local, _ in failures} <= {0, 1}, output[-3000:]
        assert all("Connection closed by peer" in cause or "Connection reset" in cause for *_, cause in failures)
    else:  # a rank stuck in an NCCL collective is aborted (init_from_env): torchrun's summary names it
        assert re.search(r"rank\s*: \d \(local_rank: \d\)", output), output[-3000:]


def test_a_node_that_never_arrives_fails_the_rendezvous_promptly(cluster_of):
    """The rendezvous fails before any rank starts, whatever the backend."""
    cluster = cluster_of("gloo", join_timeout=NEVER_ARRIVES)
    started = time.monotonic()
    node = cluster.start(spec_options(BASE))
    code = cluster.wait(node, NEVER_ARRIVES + START_SLACK)
    assert time.monotonic() - started < NEVER_ARRIVES + START_SLACK
    assert code != 0 and "RendezvousTimeoutError" in node.output(), node.output()[-3000:]
    assert "ranks on" not in node.output()  # no rank ever started
    cluster.assert_nothing_left()


def test_nccl_ranks_are_set_to_end_when_a_peer_dies(monkeypatch):
    """NCCL's own defaults leave a rank whose peer died running for minutes (docs/multinode.md): init_from_env
    sets the heartbeat to the group's timeout, connections and communicators to be made under it, and keeps a
    user's own settings."""
    names = ("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "NCCL_RUNTIME_CONNECT", "TORCH_NCCL_USE_COMM_NONBLOCKING")
    for name in names:
        monkeypatch.delenv(name, raising=False)
    _fail_on_dead_peers(12.5)
    assert [os.environ[name] for name in names] == ["13", "0", "1"]
    for name, own in zip(names, ("99", "1", "0")):
        monkeypatch.setenv(name, own)
    _fail_on_dead_peers(20)
    assert [os.environ[name] for name in names] == ["99", "1", "0"]
