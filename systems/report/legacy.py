"""Points of histories saved before each benchmark held its point whole in extra_info (systems.bench.schema).

Such a result holds its point's fields among its other figures, and a leaderboard point's pass only as the test's
parameter `pass_`. An out-of-memory point left only its test id, which is read back here.
"""

from __future__ import annotations

import re

from systems.bench.schema import ATTENTION_SWEEPS, AllReducePoint, AttentionPoint, DDPPoint, ModelPoint, Point

MODEL_ID = re.compile(r"\[(?P<preset>[^-\]]+)-ctx(?P<context>\d+)-(?P<precision>[\w-]+)-(?P<compile>\w+)"
                      r"-(?P<phase>\w+)\]")
ATTENTION_ID = re.compile(r"\[(?P<impl>\w+)-seq(?P<seq>\d+)-d(?P<d>\d+)-(?P<precision>\w+)-(?P<pass>\w+)\]")
ALLREDUCE_ID = re.compile(r"\[(?P<backend>\w+)-(?P<world_size>\d+)ranks-(?P<size_mb>[\d.]+)MiB\]")
DDP_ID = re.compile(r"\[(?P<variant>[a-z]+)(?:-(?P<bucket_size_mb>[\d.]+)MiB)?-(?P<precision>[\w-]+?)"
                    r"-ctx(?P<context>\d+)-(?P<world_size>\d+)ranks\]")
IDS = {  # (module, test): the point class and its test id
    ("bench_model", "test_model"): (ModelPoint, MODEL_ID),
    ("bench_attention", "test_handout_sweep"): (AttentionPoint, ATTENTION_ID),
    ("bench_attention", "test_flash_sweep"): (AttentionPoint, ATTENTION_ID),
    ("bench_allreduce", "test_allreduce"): (AllReducePoint, ALLREDUCE_ID),
    ("bench_ddp", "test_ddp_step"): (DDPPoint, DDP_ID),
}


def point_from_id(module: str, name: str) -> Point | None:
    """The point an old test id spells, e.g. `test_model[tiny-ctx128-fp32-eager-forward]`; None for a test
    without points. An attention id leaves out what its sweep fixes."""
    test = name.split("[")[0]
    if (module, test) not in IDS:
        return None
    cls, pattern = IDS[module, test]
    match = pattern.search(name)
    if match is None:
        return None
    fields = match.groupdict()
    if cls is AttentionPoint:
        sweep = test.removeprefix("test_").removesuffix("_sweep")
        fields.update(sweep=sweep, batch=ATTENTION_SWEEPS[sweep].batch, is_causal=ATTENTION_SWEEPS[sweep].is_causal)
    return cls.from_dict(fields)


def result_fields(fields: dict) -> dict:
    """An old result's fields as a new one holds them."""
    if "pass_" in fields and "pass" not in fields:
        return {**fields, "pass": fields["pass_"]}
    return fields
