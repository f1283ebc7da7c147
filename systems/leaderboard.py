"""The 2026 leaderboard's training step, timed as the course times it (handout 26.1.1, section 9; quoted in
docs/course-2026.md): the course's `train_step` under triton's do_bench at batch 2, context 32768, bf16, causal, on
two GPUs, from an empty cache, within 10 minutes.

`run_leaderboard(...)` runs it on every rank of a process group: the handout's inputs (`handout_inputs`), each rank
its share of the batch, our model or the course's (`Reference`) under our FSDP, and `handout_step` with FSDP's
`finish_gradient_synchronization` before the optimizer step. `course_timing` is do_bench (on a CPU, its algorithm
on the host clock), the ranks agreeing on one step estimate first (`agreed_step_ms`) so that they run as many steps.
`from_reference_state_dict` maps the reference's weights to ours; `forward_difference` compares the two forwards.
docs/design-notes.md has the handout's code and the design.
"""

from __future__ import annotations

import importlib
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from systems.model import TransformerConfig, TransformerLM
from systems.optim import AdamW
from systems.parallel.fsdp import FSDP
from systems.parallel.ranks import rank_device
from systems.precision import Precision

HANDOUT_REP_MS, HANDOUT_WARMUP_MS = 30_000, 10_000  # do_bench's budgets in the handout's call
CPU_REP_MS, CPU_WARMUP_MS = 20, 10  # a tiny model's few steps, so that CI runs the code path
ESTIMATE_STEPS = 5  # do_bench estimates a step from this many


def handout_inputs(vocab_size: int, batch: int, context: int, generator: torch.Generator | None = None):
    """`labels, targets = torch.randint(high=vocab_size, size=(2, batch, context))`: two independent draws."""
    labels, targets = torch.randint(high=vocab_size, size=(2, batch, context), generator=generator)
    return labels, targets


def handout_loss(mean_cross_entropy: torch.Tensor) -> torch.Tensor:
    """`cross_entropy(res, targets).sum()`: the course's cross_entropy is a mean over every token, a scalar."""
    return mean_cross_entropy.sum()


def handout_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, mean_loss: Callable[[], torch.Tensor],
                 losses: list | None = None) -> Callable[[], None]:
    """The handout's `train_step`: `mean_loss()` runs the forward and the course's cross_entropy; FSDP's gradient
    synchronization sits between backward and the optimizer step. `losses` collects each step's loss (no sync)."""
    def train_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = handout_loss(mean_loss())
        loss.backward()
        model.finish_gradient_synchronization()
        optimizer.step()
        if losses is not None:
            losses.append(loss.detach())
    return train_step


@dataclass(frozen=True)
class CourseTiming:
    timer: str  # "triton.testing.do_bench" or "do_bench's algorithm on the host clock"
    times_ms: list[float]  # each timed step (do_bench's "all"; only the mean where the GPU's triton has no "all")
    mean_ms: float  # the handout's figure
    median_ms: float | None
    warmup_steps: int
    rep_ms: float  # the budgets handed to the timer
    warmup_ms: float


def course_timing(step: Callable[[], None], rep_ms: float, warmup_ms: float, device: torch.device) -> CourseTiming:
    """`step` timed as the course times it (see the module's docstring), the budgets agreed between ranks."""
    step()  # do_bench's first call, before its estimate: one untimed step
    estimate = agreed_step_ms(step, device)
    warmup_steps, timed_steps = max(1, int(warmup_ms / estimate)), max(1, int(rep_ms / estimate))
    if dist.is_initialized() and dist.get_world_size() > 1:  # the same counts, halfway between two of them
        rep_ms, warmup_ms = (timed_steps + 0.5) * estimate, (warmup_steps + 0.5) * estimate
    if device.type == "cuda":
        from triton.testing import do_bench  # here: triton is this timing's GPU dependency only

        try:
            times = do_bench(step, rep=rep_ms, warmup=warmup_ms, return_mode="all")
        except AssertionError:  # an older triton without "all": its default figure alone, the mean
            times = [do_bench(step, rep=rep_ms, warmup=warmup_ms)]
            return CourseTiming("triton.testing.do_bench", times, times[0], None, warmup_steps, rep_ms, warmup_ms)
        timer = "triton.testing.do_bench"
    else:
        for _ in range(warmup_steps):
            step()
        times = [_host_ms(step) for _ in range(timed_steps)]
        timer = "do_bench's algorithm on the host clock"
    return CourseTiming(timer, list(times), statistics.mean(times), statistics.median(times), warmup_steps, rep_ms,
                  warmup_ms)


def _host_ms(step: Callable[[], None]) -> float:
    start = time.perf_counter()
    step()
    return (time.perf_counter() - start) * 1e3


def agreed_step_ms(step: Callable[[], None], device: torch.device, steps: int = ESTIMATE_STEPS) -> float:
    """A step's milliseconds, the mean of `steps` back to back (do_bench's estimate by default), the slowest rank's:
    the same on every rank, so that budgets made from it give every rank the same number of steps."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            step()
        end.record()
        torch.cuda.synchronize(device)
        estimate = start.elapsed_time(end) / steps
    else:
        estimate = sum(_host_ms(step) for _ in range(steps)) / steps
    if dist.is_initialized():
        agreed = torch.tensor([estimate], device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        estimate = agreed.item()
    return estimate


@dataclass(frozen=True)
class Reference:
    """The course's reference code: `package`.model.BasicsTransformerLM, `package`.nn_utils.cross_entropy and
    `package`.optimizer.AdamW (cs336_basics, the assignment's cs336-basics directory)."""

    package: str = "cs336_basics"

    def module(self, name: str):
        try:
            return importlib.import_module(f"{self.package}.{name}")
        except ImportError as exc:
            raise ImportError(f"the reference model needs {self.package} importable (`pip install -e "
                              f"assignment2-systems/cs336-basics`): {exc}") from None

    def model(self, config: TransformerConfig) -> torch.nn.Module:
        return self.module("model").BasicsTransformerLM(
            vocab_size=config.vocab_size, context_length=config.context_length, d_model=config.d_model,
            num_layers=config.num_layers, num_heads=config.num_heads, d_ff=config.d_ff, rope_theta=config.rope_theta)

    def cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.module("nn_utils").cross_entropy(logits, targets)

    def optimizer(self, parameters) -> torch.optim.Optimizer:
        return self.module("optimizer").AdamW(parameters)


def run_leaderboard(model_name: str, config: TransformerConfig, precision: Precision, batch: int, rep_ms: float,
                    warmup_ms: float, reference: Reference = Reference(), seed: int = 0) -> dict:
    """On every rank: the handout's step on its share of the batch, timed by `course_timing`."""
    device, rank, world = rank_device(), dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)  # the handout draws from the global generator: the same batch on every rank
    labels, targets = handout_inputs(config.vocab_size, batch, config.context_length)
    mine = slice(rank * batch // world, (rank + 1) * batch // world)
    labels, targets = labels[mine].to(device), targets[mine].to(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with torch.device(device):
        module = TransformerLM(config) if model_name == "ours" else reference.model(config)
    module = module.to(precision.weights)
    if model_name != "ours":  # the handout's torch_dtype throughout: the reference's RoPE table, a buffer FSDP
        for buffer in module.buffers():  # does not cast, in the compute dtype too (its q and k would be fp32)
            if buffer.is_floating_point():
                buffer.data = buffer.data.to(precision.compute)
    model = FSDP(module, compute_dtype=precision.compute)
    if model_name == "ours":
        optimizer = AdamW(model.parameters())
        mean_loss = lambda: model(labels, targets)  # noqa: E731: the mean cross-entropy, made in the LM head
    else:
        optimizer = reference.optimizer(model.parameters())
        mean_loss = lambda: reference.cross_entropy(model(labels), targets)  # noqa: E731
    losses = []
    timing = course_timing(handout_step(model, optimizer, mean_loss, losses), rep_ms, warmup_ms, device)
    first = losses[0].float()
    dist.all_reduce(first)
    return {"timing": timing, "first_loss": first.item() / world,
            "peak_memory_mb": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None}


# The reference's parameter names -> ours; {i} a block's index. q_proj, k_proj and v_proj make our qkv.
_NAMES = {"token_embeddings.weight": "embedding.weight", "ln_final.weight": "final_norm.weight",
          "lm_head.weight": "lm_head.weight", "layers.{i}.attn.output_proj.weight": "blocks.{i}.attn.out.weight",
          "layers.{i}.ln1.weight": "blocks.{i}.attn_norm.weight", "layers.{i}.ln2.weight": "blocks.{i}.ffn_norm.weight",
          **{f"layers.{{i}}.ffn.w{k}.weight": f"blocks.{{i}}.ffn.w{k}.weight" for k in (1, 2, 3)}}
_QKV = ("q_proj", "k_proj", "v_proj")


def from_reference_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our TransformerLM's state dict from the reference's (BasicsTransformerLM's): every name mapped, the three
    projections stacked as our qkv's rows [q; k; v] (each head-major, as the reference splits heads)."""
    mapped, qkv = {}, {}
    patterns = [(re.compile(re.escape(theirs).replace(r"\{i\}", r"(\d+)") + "$"), ours)
                for theirs, ours in _NAMES.items()]
    for name, tensor in state.items():
        projection = re.fullmatch(r"layers\.(\d+)\.attn\.(q_proj|k_proj|v_proj)\.weight", name)
        if projection:
            qkv.setdefault(projection[1], {})[projection[2]] = tensor
            continue
        for pattern, ours in patterns:
            match = pattern.fullmatch(name)
            if match:
                mapped[ours.replace("{i}", match[1]) if match.groups() else ours] = tensor
                break
        else:
            raise KeyError(f"no name of ours for the reference's {name!r}")
    for block, projections in qkv.items():
        missing = [p for p in _QKV if p not in projections]
        if missing:
            raise KeyError(f"layers.{block}.attn lacks {', '.join(missing)}")
        mapped[f"blocks.{block}.attn.qkv.weight"] = torch.cat([projections[p] for p in _QKV])
    return mapped


def forward_difference(reference: torch.nn.Module, config: TransformerConfig, tokens: torch.Tensor) -> float:
    """max |our logits - the reference's| over `tokens`, on the reference's weights mapped to ours, in the
    reference's dtype and device; relative to the largest logit."""
    ours = TransformerLM(config).to(next(reference.parameters()))
    ours.load_state_dict(from_reference_state_dict(reference.state_dict()))
    with torch.no_grad():
        theirs, mine = reference(tokens), ours(tokens)
    return ((mine - theirs).abs().max() / theirs.abs().max()).item()

