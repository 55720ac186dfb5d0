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


SWEEP = ["model=tiny,tiny_moe", "hardware=cpu", "cluster.nodes=2", "hardware.gpus_per_node=4", "layout.tp=1,2",
         "training.recompute=none,full", "hardware.gpu_memory_gb=40,80.5", "layout.order=auto,[tp,cp,pp,dp]"]
ODD_POINTS = [  # each composed whole (or refused) exactly as compose(point) does
    ["model=tiny", "hardware=cpu", "layout.tpp=2"], ["model=tiny", "layout.tp=abc"], ["model=tiny", "+foo=1"],
    ["model=tiny", "training.data=null", "layout.dp=auto", "layout.stage_layers=[1,3]", "layout.pp=2"],
    ["model=tiny", "launcher=slurm", "launcher.partition=gpu", "stack=torchtitan"], ["model=tiny", "launcher.partition=x"],
    ["model=tiny", "published.mfu=0.4"], ["model=tiny", "training.seq_len=${training.global_batch}"],
    ["model=tiny", "hardware=nope"], ["model=tiny", "schedule=gpipe", "schedule.microbatches=8", "figures=false"],
    ["model=tiny", "layout.zero=null", "model.moe.score=softmax", "training.lr=1"],
]


def test_sweep_points_vary_one_composed_config_as_composing_each_point_would():
    from orchestrator import compose, make_plan
    from orchestrator.config.compose import to_dict, typed
    from orchestrator.config.errors import ConfigError
    from orchestrator.config.points import Points
    from orchestrator.launch.sweep import expand

    regular = expand(SWEEP)
    assert len(regular) == 2 ** 5
    configs = Points()
    for i, point in enumerate(regular + ODD_POINTS):
        if i == len(regular):  # the value overrides were applied to one composed config per model
            assert configs.composed == 2
        try:
            want = typed(compose(point))
        except ConfigError as e:
            with pytest.raises(ConfigError) as got:
                configs.typed(point)
            assert got.value.problems == e.problems, point
            continue
        got = configs.typed(point)
        assert json.dumps(to_dict(got)) == json.dumps(to_dict(want)), point  # types too: 40.0 is not 40
        assert make_plan(got).to_json() == make_plan(want).to_json(), point


def test_config_defaults_are_the_yaml_presets():
    """Config() is what `orchestrate` composes with no override, group by group and key by key,
    so a config built in Python plans the stack the command line plans."""
    import dataclasses

    from orchestrator import compose, make_plan
    from orchestrator.config.compose import to_dict, typed
    from orchestrator.config.schema import Config

    built, composed = to_dict(Config()), to_dict(typed(compose([])))
    assert [f.name for f in dataclasses.fields(Config)] == list(built)
    for group in built:
        assert json.dumps(built[group]) == json.dumps(composed[group]), group
    spec = Config()
    spec.cluster.nodes, spec.layout.pp = 4, 2  # ZeRO-3 under pipelining: this stack keeps the weights gathered
    want = make_plan(compose(["cluster.nodes=4", "layout.pp=2"]))
    got = make_plan(spec)
    assert got.layout.zero == want.layout.zero == 2
    assert got.to_json() == want.to_json()
    # a plain mapping's own groups merge onto the bare schema (as a preset file does); the rest are the presets
    d = make_plan({"cluster": {"nodes": 4}, "layout": {"pp": 2}})
    assert d.to_json() == want.to_json()
