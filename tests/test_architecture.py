"""The shape of the code: layers that import one way, registries read by planner and
runtime alike, torch-free planning and launching, and a wheel that composes anywhere."""
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import code_shape  # noqa: E402


def test_no_import_cycles_and_no_import_against_the_layers():
    g = code_shape.graph(ROOT / "orchestrator")
    assert code_shape.cycles(g) == []
    assert code_shape.upward(g) == []
    # the CLI only parses and dispatches: nothing below imports it
    assert [m for m, deps in g.items() if "orchestrator.cli" in deps] == ["orchestrator.__main__"]


def test_the_layer_check_catches_an_import_against_the_layers():
    g = {"orchestrator.plan.x": {"orchestrator.launch.y"}, "orchestrator.launch.y": set(),
         "orchestrator.train.t": {"orchestrator.launch.y"}}
    assert code_shape.upward(g) == ["orchestrator.plan.x -> orchestrator.launch.y",
                                    "orchestrator.train.t -> orchestrator.launch.y"]
    assert code_shape.cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b"]]


def test_every_schedule_entry_is_one_the_runtime_and_the_config_know():
    import torch.distributed.pipelining.schedules as S

    from orchestrator.config.compose import compose
    from orchestrator.config.schedules import SCHEDULES
    from orchestrator.config.schema import Schedule

    assert [s.value for s in Schedule] == list(SCHEDULES)
    for name, spec in SCHEDULES.items():
        assert compose([f"schedule={name}"]).schedule.name.value == name  # a config group option
        if spec.torch_class is not None:
            assert issubclass(getattr(S, spec.torch_class), S._PipelineSchedule), name
        for pp in (2, 4):
            stages = [j for r in range(pp) for j in spec.stages_of_rank(r, pp, 2)]
            assert sorted(stages) == list(range(spec.stages(pp, 2)))  # every stage on exactly one rank
            assert all(spec.rank_of_stage(j, pp) == r for r in range(pp) for j in spec.stages_of_rank(r, pp, 2))


def _run_without_torch(code: str, cwd=ROOT) -> subprocess.CompletedProcess:
    prog = "import sys; sys.modules['torch'] = None\n" + code  # any `import torch` now fails
    return subprocess.run([sys.executable, "-c", prog], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_planning_and_launching_never_import_torch(tmp_path):
    """A SLURM supervisor or a login node without torch can plan, launch and record failovers."""
    code = f"""
import importlib, pathlib
for f in sorted(pathlib.Path('orchestrator').rglob('*.py')):
    mod = '.'.join(f.with_suffix('').parts).removesuffix('.__init__')
    if not mod.startswith('orchestrator.train') and mod != 'orchestrator.__main__':
        importlib.import_module(mod)
from orchestrator import compose, make_plan
from orchestrator.rundir import events
plan = make_plan(compose(['recipe=deepseek_v3', 'layout=auto']))
assert plan.valid
events.record(pathlib.Path({str(tmp_path)!r}), {{'mode': 'restart', 'new_layout': {{'dp': 2}}, 'steps_lost': 1}})
print('TORCH_FREE_OK')
"""
    r = _run_without_torch(code)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "TORCH_FREE_OK" in r.stdout
    assert (tmp_path / "failover.json").exists() and list((tmp_path / "tensorboard").iterdir())


def test_the_runtime_refuses_before_launch_what_it_cannot_train(cli):
    r = cli("recipe=deepseek_v3", "launcher=local", "figures=false")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    for key in ("[schedule.name]", "[model.moe.max_nodes_per_token]", "[model.mla]", "[training.precision]"):
        assert key in r.stderr, r.stderr
    assert not (cli.dir / "logs").exists()
    assert cli("recipe=deepseek_v3", "figures=false").returncode == 0  # the dry launcher still plans it
    # planned, not trained: ZeRO-1's optimizer-only sharding and multi-token prediction
    r = cli("model=tiny", "hardware=cpu", "launcher=local", "figures=false", "layout.zero=1", "training.mtp_depth=1")
    assert r.returncode == 2 and "[layout.zero]" in r.stderr and "[training.mtp_depth]" in r.stderr, r.stderr


def test_a_built_wheel_composes_and_plans_from_another_directory(tmp_path):
    """conf/, recipes/ and published/ ship inside the package: an installed orchestrator needs no
    checkout."""
    dist = tmp_path / "dist"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist),
                        str(ROOT)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (wheel,) = dist.glob("orchestrator-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "orchestrator/conf/config.yaml" in names and "orchestrator/recipes/llama3_405b.yaml" in names
    assert {"orchestrator/published/runs.csv", "orchestrator/published/calibration.csv"} <= set(names)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    r = subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    # The dependencies come from the development environment (a .pth line); orchestrator itself
    # only from the wheel: that environment's editable install is not activated by a path line.
    site = next((venv / "lib").glob("python*/site-packages"))
    deps = next(Path(p) for p in sys.path if p.endswith("site-packages") and (Path(p) / "hydra").is_dir())
    (site / "deps.pth").write_text(str(deps) + "\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([str(venv / "bin" / "orchestrate"), "recipe=llama3_405b", "figures=false",
                        f"hydra.run.dir={elsewhere / 'run'}"], cwd=elsewhere, capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert (elsewhere / "run" / "plan.json").exists()
    r = subprocess.run([str(py), "-c", "import orchestrator; print(orchestrator.__file__)"], cwd=elsewhere,
                       capture_output=True, text=True, env=env)
    assert str(site) in r.stdout, r.stdout
    # the published-runs harness finds its CSVs inside the installed package and plans a row as
    # the checkout does
    from orchestrator.published.calibrate import load_runs, predict_one

    here = load_runs()
    first = predict_one(here[0])
    code = ("from orchestrator.published.calibrate import RUNS_CSV, load_runs, predict_one\n"
            "rows = load_runs(); p = predict_one(rows[0])\n"
            "print(RUNS_CSV); print(len(rows), rows[0].name, repr(p.predicted), repr(p.truth))")
    r = subprocess.run([str(py), "-c", code], cwd=elsewhere, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    where, got = r.stdout.splitlines()[-2:]
    assert Path(where) == site / "orchestrator" / "published" / "runs.csv"
    assert got == f"{len(here)} {here[0].name} {first.predicted!r} {first.truth!r}"


@pytest.mark.parametrize("launcher", ["dry", "local", "slurm"])
def test_each_launcher_has_its_own_settings(launcher):
    """Keys of one launcher are refused for another at compose time, naming the owner."""
    from orchestrator.config.compose import compose
    from orchestrator.config.errors import ConfigError

    cfg = compose([f"launcher={launcher}"])
    assert cfg.launcher.name.value == launcher
    if launcher != "slurm":
        with pytest.raises(ConfigError) as err:
            compose([f"launcher={launcher}", "launcher.partition=gpu"])
        assert "launcher=slurm" in err.value.problems[0].fix
