"""`orchestrate -m` reads every sweep expression of Hydra's override grammar as Hydra does: for each
form, the points (and their order) are those Hydra's own BasicSweeper hands its launcher in a bare
`@hydra.main` app over the packaged conf/ (tests/hydra_sweep_ref.py, one process for all forms),
and where Hydra refuses the sweep, so do we, with Hydra's reason."""
import json
import random
import subprocess
import sys

import pytest
import yaml

from conftest import ROOT, run_cli

FORMS = [
    ["layout.tp=choice(4,1)", "model=tiny,tiny_moe"],  # several swept keys: their product, in order
    ["layout.tp=range(8,0,-3)", "hardware.gpu_memory_gb=range(10.5,11.5,0.5)"],  # descending, float
    ["layout.tp=interval(1,4)"],  # the basic sweeper refuses a continuous interval
    ["hardware=glob(h*)"], ["hardware=glob(*,exclude=[cpu,h*,a*,g*])"], ["recipe=glob(llama3_405b*,exclude=*long*)"],
    ["schedule=glob(*1f1b)"],  # a group from the ConfigStore, not a folder
    ["hardware=glob(zz*)"], ["layout.tp=glob(*)"], ["layout.tp=range(4,1)"],  # Hydra runs nothing; we say why
    ["layout.tp=sort(4,1,2)"], ["layout.pp=sort(range(1,4),reverse=true)"],
    ["layout.tp=shuffle(1,2,4,8)"], ["layout.tp=sort(shuffle(1,2,4))"],
    ["layout.tp=shuffle(1,2,4,seed=3)"],  # Hydra's shuffle takes no seed: refused
    ["layout.tp=tag(small,choice(1,2))"], ["layout.tp=tag(small,1,2)"],  # tags go on a sweep, not on values
    ["+foo=1,2"], ["++layout.tp=1,2"], ["~layout.tp"], ["+x={a:1},{b:2}"],
    ["model.name='a,b',c", "training.seq_len=64"],  # a quoted comma is a value, not a sweep
    ["layout.order=[tp,dp],[dp,tp]", "layout.stage_layers=[1,3]"],  # lists as values
    ["layout.tp=1,2", "layout.tp=4", "layout.pp=1,2"],  # a key given twice: first place, last value
    ["layout.tp=1,2", "hydra.job.name=x"],  # Hydra's own keys are not a point's
    ["hydra.job.name=a,b"], ["layout.tp=[1,2"], ["layout.tp=1,2", "layout.tpp=3"],
]
SITE_FORMS = [["hardware=glob([site*,h1*])", "layout.tp=1,2"]]  # with --config-dir: the site's options too


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    d = tmp_path_factory.mktemp("site")
    (d / "hardware").mkdir()
    (d / "hardware" / "site_gpu.yaml").write_text(yaml.safe_dump(
        {"name": "site_gpu", "gpus_per_node": 4, "gpu_memory_gb": 141, "peak_tflops": 1234.0, "intra_node_gbps": 300,
         "inter_node_gbps": 40}))
    return d


@pytest.fixture(scope="module")
def hydra_says(site, tmp_path_factory):
    """What the bare Hydra app made of each form: {"points": [...]} or {"error": "..."}."""
    tmp = tmp_path_factory.mktemp("ref")
    lines = FORMS + [["--config-dir", str(site), *f] for f in SITE_FORMS]
    (tmp / "in.json").write_text(json.dumps(lines))
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "hydra_sweep_ref.py"), str(tmp / "in.json"),
                        str(tmp / "out.json")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads((tmp / "out.json").read_text())
    return {json.dumps(f): o for f, o in zip(FORMS, out)} | {
        json.dumps(f): o for f, o in zip(SITE_FORMS, out[len(FORMS):])}


def _ours(form, config_dir=None):
    from orchestrator.config.errors import ConfigError
    from orchestrator.launch.sweep import expand

    random.seed(0)  # shuffle() draws from Python's random, as in the reference app
    try:
        return expand(form, config_dir), None
    except ConfigError as e:
        return None, e.problems


def _reasons(hydra_error: str) -> list[str]:
    """The lines of Hydra's refusal that say why (not its traceback, banner or links)."""
    out = []
    for line in hydra_error.splitlines():
        line = line.strip()
        if line.startswith(("hydra.errors.", "omegaconf.errors.")):
            line = line.split(": ", 1)[1]
        if len(line) > 15 and not line.startswith(("File ", "Traceback", "See https", "Set the environment",
                                                   "Error parsing override", "^", "full_key", "object_type",
                                                   "reference_type", "return ", "raise ")):
            out.append(line)
    return out


@pytest.mark.parametrize("form", FORMS + SITE_FORMS, ids=lambda f: " ".join(f))
def test_sweep_points_are_hydras(form, hydra_says, site):
    from orchestrator.config.errors import ConfigError
    from orchestrator.config.points import Points

    hydra = hydra_says[json.dumps(form)]
    points, problems = _ours(form, str(site) if form in SITE_FORMS else None)
    if "points" in hydra and hydra["points"]:
        assert problems is None, problems
        assert points == hydra["points"]
    elif "points" in hydra:  # Hydra would run nothing without a word: refused, naming the key
        assert points is None and [p.key for p in problems] == [form[0].split("=")[0]], problems
        assert all(p.fix for p in problems)
    elif problems is not None:  # the grammar, or the sweeper, refused it: with Hydra's reason
        said = " ".join(str(p) for p in problems)
        assert any(reason in said for reason in _reasons(hydra["error"])), (said, hydra["error"])
        assert all(p.key and p.fix for p in problems)
    else:  # Hydra refused composing the sweep's config: every point of ours is refused composing
        configs = Points(str(site) if form in SITE_FORMS else None)
        for point in points:
            with pytest.raises(ConfigError):
                configs.typed(point)


def test_the_cli_sweeps_a_glob_over_a_sites_presets_and_refuses_an_interval(tmp_path, site, hydra_says):
    form = SITE_FORMS[0]
    r = run_cli(["-m", "-cd", str(site), *form, "model=tiny", "cluster.nodes=1"], tmp_path)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    rows = json.loads((tmp_path / "sweep" / "sweep.json").read_text())["points"]
    want = [p + ["model=tiny", "cluster.nodes=1"] for p in hydra_says[json.dumps(form)]["points"]]
    assert [row["overrides"] for row in rows] == want
    assert {json.loads((tmp_path / "sweep" / str(i) / "plan.json").read_text())["config"]["hardware"]["name"]
            for i in range(len(rows))} == {"site_gpu", "h100_sxm"}
    r = run_cli(["-m", "layout.tp=interval(1,4)", "model=tiny"], tmp_path / "interval")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "[layout.tp]" in r.stderr and "INTERVAL_SWEEP" in r.stderr
    assert not (tmp_path / "interval" / "sweep").exists()  # refused before anything was written


def test_a_sweep_without_multirun_is_refused_naming_its_key():
    from orchestrator import compose
    from orchestrator.config.errors import ConfigError

    for override, key in (("layout.tp=1,2", "layout.tp"), ("hardware=glob(h*)", "hardware"),
                          ("training.seq_len=range(64,256,64)", "training.seq_len")):
        with pytest.raises(ConfigError) as e:
            compose(["model=tiny", override])
        (p,) = e.value.problems
        assert p.key == key and "-m" in p.message and p.fix, p
