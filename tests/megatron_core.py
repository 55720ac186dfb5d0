"""Megatron-Core's own process groups, for the tests: its real `initialize_model_parallel`
(megatron/core/parallel_state.py, both RankGenerators and every assertion between them) run in a
subprocess beside the project's torch (tests/frameworks.py installs the release), with
torch.distributed answered by a recorder: a world of the given size, and each `new_group(ranks,
group_desc=...)` call written down instead of made. Nothing of Megatron's is copied here.
"""
from __future__ import annotations

import json

import pytest

import frameworks

RELEASE = "megatron-core-0.16.1"

_CODE = r"""
import json, sys, warnings
warnings.simplefilter("ignore")
import torch.distributed as dist
from megatron.core import parallel_state as ps

made = {}
def new_group(ranks=None, group_desc=None, **kw):
    made.setdefault(group_desc, []).append(list(ranks))
    return object()
dist.is_initialized = lambda: True
dist.get_rank = lambda group=None: 0
dist.new_group = new_group
out = []
for world, kwargs in json.loads(CASES):
    made.clear()
    dist.get_world_size = lambda group=None, world=world: world
    ps.destroy_model_parallel()
    try:
        ps.initialize_model_parallel(**kwargs)
        out.append({} if ONLY_REFUSALS else {k: v for k, v in made.items() if not k.endswith("_GLOO")})
    except (AssertionError, RuntimeError, ValueError) as e:
        out.append({"refused": f"{type(e).__name__}: {e}"})
    if ONLY_REFUSALS:  # its two generators' pipeline groups, compared even where an earlier check refused
        tp, cp, pp, ep = (kwargs.get(k, 1) for k in ("tensor_model_parallel_size", "context_parallel_size",
                                                    "pipeline_model_parallel_size", "expert_model_parallel_size"))
        etp = kwargs.get("expert_tensor_parallel_size") or tp
        if world % (tp * cp * pp) == 0 and world % (etp * ep * pp) == 0:
            dense = ps.RankGenerator(tp=tp, ep=1, dp=world // (tp * cp * pp), pp=pp, cp=cp, order=kwargs["order"])
            expert = ps.RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order=kwargs["order"])
            out[-1]["pp_groups_differ"] = dense.get_ranks("pp") != expert.get_ranks("pp")
print("RESULT " + json.dumps(out))
"""

# group_desc in parallel_state.py -> the plan's axes it spans
DENSE = {"tp": "TENSOR_MODEL_PARALLEL_GROUP", "cp": "CONTEXT_PARALLEL_GROUP", "dp": "DATA_PARALLEL_GROUP",
         "pp": "PIPELINE_MODEL_PARALLEL_GROUP", "dp-cp": "DATA_PARALLEL_GROUP_WITH_CP"}
EXPERT = {"ep": "EXPERT_MODEL_PARALLEL_GROUP", "etp": "EXPERT_TENSOR_PARALLEL_GROUP",
          "edp": "EXPERT_DATA_PARALLEL_GROUP", "etp-ep": "EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP",
          "etp-ep-pp": "EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP"}


def groups(cases: list[tuple[int, dict]], only_refusals: bool = False) -> list[dict[str, list[list[int]]]]:
    """For each (world size, initialize_model_parallel keyword arguments): group_desc -> its
    groups of ranks, in the order Megatron-Core creates them, or {"refused": why} (with
    `only_refusals`, {} where it accepts)."""
    if not frameworks.installed(RELEASE):
        pytest.skip(f"{RELEASE} is not installed: python tests/frameworks.py (make test does)")
    r = frameworks.run(RELEASE, f"CASES = {json.dumps(cases)!r}\nONLY_REFUSALS = {only_refusals}\n" + _CODE)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def kwargs_of(flags: dict[str, str], order: str) -> dict:
    """initialize_model_parallel's arguments as Megatron-LM's initialize.py passes them from the
    rendered command line (megatron/training/initialize.py:377-396)."""
    tp = int(flags["--tensor-model-parallel-size"])
    return dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=int(flags["--pipeline-model-parallel-size"]),
                context_parallel_size=int(flags["--context-parallel-size"]),
                expert_model_parallel_size=int(flags.get("--expert-model-parallel-size", 1)),
                expert_tensor_parallel_size=int(flags.get("--expert-tensor-parallel-size", tp)),
                num_distributed_optimizer_instances=int(flags.get("--num-distributed-optimizer-instances", 1)),
                order=order)
