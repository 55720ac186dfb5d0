"""The run directory's contract: strict JSON out of the planner, the sweep's points equal to
composing each point alone, one default per setting (the YAML presets)."""
import json
import math

import pytest

from conftest import plan_of


def strict_load(text: str):
    """json.loads that refuses NaN, Infinity and -Infinity, as strict JSON readers do."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


STRICT_CASES = [
    ["hardware.failures_per_gpu_hour=0"],  # no failure expected: the job MTBF is unbounded
    ["recipe=deepseek_v3", "layout=auto"],  # a search, MoE, MLA
    ["hardware=cpu", "model=tiny", "cluster.nodes=2", "hardware.gpus_per_node=4", "layout.tp=3"],  # invalid
    ["hardware.storage_gbps=0"],
    ["recipe=llama3_405b", "hardware.failures_per_gpu_hour=0", "training.steps=0"],
]


@pytest.mark.parametrize("overrides", STRICT_CASES, ids=lambda o: " ".join(o))
def test_plan_json_is_strict_json(tmp_path, overrides):
    from orchestrator.plan.artifacts import write_plan

    plan = plan_of(*overrides)
    paths = write_plan(plan, tmp_path, figures=False)
    data = strict_load(paths["json"].read_text())
    assert data["valid"] == plan.valid
    if "hardware.failures_per_gpu_hour=0" in overrides:
        assert math.isinf(plan.blast_radius["job_mtbf_hours"])  # what the planner computes ...
        assert data["blast_radius"]["job_mtbf_hours"] is None  # ... is null in plan.json (unbounded)
        assert data["blast_radius"]["checkpoint_interval_s"] is None
