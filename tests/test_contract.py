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
    from orchestrator.report.artifacts import write_plan

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


def test_attempt_directories_are_made_and_read_in_one_place(tmp_path):
    from orchestrator import rundir

    run = tmp_path / "run"
    run.mkdir()
    (run / rundir.PLAN_JSON).write_text("{}")
    for n in (10, 2):
        (rundir.make_attempt_dir(run, n) / rundir.PLAN_JSON).write_text("{}")
    rundir.make_attempt_dir(run, 3)  # no plan: not an attempt that ran
    (run / "attempt_x").mkdir()
    assert rundir.attempt_dirs(run) == [run, run / "attempt2", run / "attempt10"]
    assert [rundir.attempt_number(d, run) for d in rundir.attempt_dirs(run)] == [0, 2, 10]
    assert rundir.attempt_number(run / "attempt_x", run) is None
    assert rundir.attempt_number(tmp_path / "attempt4", run) is None  # another run's folder
    assert rundir.attempt_plan_path(run, 3) == run / rundir.PLAN_JSON  # attempt 3 ran attempt 0's plan


def test_the_measured_step_has_one_rule_everywhere(tmp_path):
    """runs.summary, the sweep's measure, the measured-vs-predicted rows and measure.py read the
    same number: the latest attempt's steps, its first (warm-up) step left out, median."""
    from orchestrator import rundir
    from orchestrator.launch import runs, sweep
    from orchestrator.launch.status import write_status
    from orchestrator.measure import measured_step_time
    from orchestrator.report.artifacts import write_plan
    from orchestrator.rundir.metrics import measured_rows

    run = tmp_path / "run"
    plan = plan_of("hardware=cpu", "model=tiny", "cluster.nodes=1", "hardware.gpus_per_node=2")
    write_plan(plan, run, figures=False)
    write_status(run, state="completed")
    times = {0: [9.0, 1.0, 1.2, 1.1, 1.3], 1: [7.0, 2.0, 2.4, 2.2]}  # attempt 1 re-ran steps 2.. after a failover
    with open(run / rundir.METRICS_JSONL, "w") as f:
        for attempt, ts in times.items():
            for i, t in enumerate(ts):
                f.write(json.dumps({"step": i + 2 * attempt, "loss": 1.0, "step_time_s": t, "attempt": attempt}) + "\n")
    want = 2.2  # median of attempt 1 after its warm-up step: [2.0, 2.4, 2.2]
    assert rundir.measured_step_s(rundir.last_attempt_times(run)) == want
    assert runs.summary(run)["measured_step_s"] == want
    row = {"dir": str(run)}
    sweep.measure(row)
    assert row["measured_step_s"] == want
    assert measured_rows(run)[-1]["median_s"] == want and measured_rows(run)[0]["median_s"] == 1.15
    assert measured_step_time(run) == want
    assert rundir.measured([3.0]) == [3.0] and rundir.measured([3.0, 1.0]) == [1.0]


def test_compose_leaves_hydra_to_its_caller():
    """compose() keeps its own Hydra: a notebook's hydra.initialize() works after it, and compose after that."""
    import hydra
    from hydra.core.global_hydra import GlobalHydra

    from orchestrator import compose
    from orchestrator.config.paths import CONF_DIR

    assert compose(["model=tiny"]).model.name == "tiny"
    assert not GlobalHydra.instance().is_initialized()
    with hydra.initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        assert hydra.compose(config_name="config", overrides=["model=tiny_moe"]).model.name == "tiny_moe"
        assert compose(["model=llama3_8b"]).model.name == "llama3_8b"
        assert GlobalHydra.instance().is_initialized()  # the caller's, untouched


def test_a_saves_file_list_is_files_json_and_older_saves_with_manifest_json_still_verify(tmp_path):
    """A save's file list (size and SHA-256 per file) is files.json, so manifest.json names only
    the run's manifest; a save written before the rename (its list in manifest.json) still
    verifies, and a changed file is still caught in it."""
    from orchestrator import rundir
    from orchestrator.rundir import checkpoints as ckpt

    url = str(tmp_path / "ck")
    d = tmp_path / "ck" / "step_00000003"
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(b"weights" * 100)
    (d / "meta.json").write_text(json.dumps({"step": 3}))
    files = ckpt.digest_own_files(url, 3, rank=0)
    ckpt.write_file_list(url, 3, files)
    assert sorted(p.name for p in d.iterdir()) == ["__0_0.distcp", ckpt.FILES_JSON, "meta.json"]
    assert ckpt.FILES_JSON != rundir.RUN_MANIFEST
    assert ckpt.verify(url, 3) == []
    (d / ckpt.FILES_JSON).rename(d / "manifest.json")  # how an older save holds the same list
    assert ckpt.verify(url, 3) == []
    (d / "__0_0.distcp").write_bytes(b"Weights" * 100)
    assert ckpt.verify(url, 3) == ["__0_0.distcp: its contents changed (SHA-256 differs from files.json)"]
    (d / "manifest.json").unlink()
    (problem,) = ckpt.verify(url, 3)
    assert "files.json or meta.json" in problem


def test_the_runtime_reads_an_attempts_plan_through_one_typed_reader(cli):
    """RunPlan (rundir/plan.py) is plan.json as the trainer, its meshes and its expert steps read
    it: the same degrees, grids and predictions as the file, the config typed; fault settings
    come from it too (the launcher's fault step is the rank's)."""
    from orchestrator import rundir
    from orchestrator.config.schema import Config
    from orchestrator.launch import faults
    from orchestrator.rundir.plan import RunPlan

    r = cli("model=tiny_moe", "hardware=cpu", "cluster.nodes=2", "hardware.gpus_per_node=4", "layout.tp=2",
            "fault.kill_node=1", "fault.mode=random", "fault.seed=7", "training.steps=20", "figures=false")
    assert r.returncode == 0, r.stderr[-2000:]
    raw = strict_load((cli.dir / rundir.PLAN_JSON).read_text())
    plan = RunPlan.load(cli.dir)
    assert plan == RunPlan.load(cli.dir / rundir.PLAN_JSON) == RunPlan.of(raw)
    assert plan.path == cli.dir / rundir.PLAN_JSON and plan.data == raw
    assert {k: plan.layout[k] for k in ("tp", "cp", "pp", "dp", "dp_shard", "ep")} == \
        {k: raw["layout"][k] for k in ("tp", "cp", "pp", "dp", "dp_shard", "ep")}
    assert plan.layout["tp"] == 2 and plan.world_size == raw["world_size"] == 8
    assert plan.ranks == raw["ranks"] and plan.expert_ranks == raw["expert_ranks"] is not None
    assert plan.grid(expert=True) == raw["expert_ranks"] and plan.mesh == raw["mesh"]
    assert (plan.predicted_mfu, plan.predicted_tflops_per_gpu, plan.predicted_step_s) == \
        (raw["mfu"], raw["tflops_per_gpu"], raw["step"]["wall_s"])
    assert plan.axis("tp") == next(a for a in raw["axes"] if a["name"] == "tp") and plan.axis("nope") is None
    assert isinstance(plan.config, Config) and plan.config.model.moe.experts == raw["config"]["model"]["moe"]["experts"]
    assert plan.config.training.steps == 20 and plan.config_json == raw["config"]
    assert plan.fault_step == faults.armed_step(plan.config) is not None and 1 <= plan.fault_step < 20
    # the run directory's names, read back from a path alone
    a2 = rundir.attempt_dir(cli.dir, 2)
    assert rundir.run_dir_of(a2) == cli.dir == rundir.run_dir_of(cli.dir)
    assert rundir.attempt_of(a2) == 2 and rundir.attempt_of(cli.dir) == 0
    assert rundir.run_dir_of(cli.dir / "attempt_x") == cli.dir / "attempt_x"
    assert rundir.rank_log(a2, 3) == a2 / rundir.LOGS / "rank3.log"


def test_the_runtimes_json_is_strict(tmp_path):
    """A NaN loss or an infinite figure is written as null (metrics.jsonl, metrics.json,
    profile.json, a plan.json rewritten with its placement), never as NaN or Infinity."""
    from orchestrator import rundir

    line = rundir.dumps({"step": 3, "loss": float("nan"), "step_time_s": 0.5}, indent=None)
    assert "\n" not in line and strict_load(line) == {"step": 3, "loss": None, "step_time_s": 0.5}
    assert line == json.dumps({"step": 3, "loss": None, "step_time_s": 0.5})  # the same text as json.dumps else
    path = rundir.write_json(tmp_path / rundir.METRICS_JSON, {"loss": [1.0, float("nan")], "mtbf": float("inf")})
    assert strict_load(path.read_text()) == {"loss": [1.0, None], "mtbf": None}
    assert [p.name for p in tmp_path.iterdir()] == [rundir.METRICS_JSON]  # written whole, no temporary left
