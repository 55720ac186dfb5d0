"""The command line behaves like a Hydra app: Hydra's flags, a site's presets through
--config-dir, unknown flags refused. Each subprocess is a dry plan or a config print."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, run_cli

SITE_GPU = {"name": "site_gpu", "gpus_per_node": 4, "gpu_memory_gb": 141, "peak_tflops": 1234.0,
            "intra_node_gbps": 300, "inter_node_gbps": 40}


@pytest.fixture
def site(tmp_path) -> Path:
    """A site's own presets outside the checkout: a GPU, and a primary config built on the packaged one."""
    d = tmp_path / "site"
    (d / "hardware").mkdir(parents=True)
    (d / "hardware" / "site_gpu.yaml").write_text(yaml.safe_dump(SITE_GPU))
    (d / "site.yaml").write_text("defaults:\n  - config\n  - override hardware: site_gpu\n  - _self_\n"
                                 "cluster:\n  nodes: 3\n")
    return d


def orchestrate(*args, env=None, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, **(env or {})))


def test_an_unknown_flag_is_refused_with_the_accepted_ones(tmp_path):
    for bad in (["--bogus", "model=tiny"], ["-cp", "conf"], ["--cfg", "job", "--info"]):
        r = run_cli(bad, tmp_path)
        assert r.returncode == 2, (bad, r.stdout[-500:], r.stderr[-500:])
        assert "REJECTED" in r.stderr and "Traceback" not in r.stderr
        for flag in ("--config-dir, -cd", "--config-name, -cn", "--cfg, -c", "--info, -i", "--shell-completion, -sc"):
            assert flag in r.stderr, (bad, r.stderr)
        assert not (tmp_path / "run" / "plan.json").exists()  # nothing planned or written


def test_a_site_adds_a_gpu_preset_with_config_dir(tmp_path, site):
    r = run_cli(["-cd", str(site), "hardware=site_gpu", "model=tiny", "cluster.nodes=2", "figures=false"], tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert {k: plan["config"]["hardware"][k] for k in SITE_GPU} == SITE_GPU  # the site's numbers were planned
    assert plan["valid"] and "on 8 x site_gpu (2 nodes x 4)" in r.stdout
    # where the config came from is kept, so `orchestrate-runs resume` composes from the same folders
    from orchestrator.launch.runs import resume_sources

    assert resume_sources(tmp_path / "run") == {"config_name": "config", "config_dir": str(site)}
    # without the folder the option does not exist: refused, naming the group and the options
    r = run_cli(["hardware=site_gpu", "model=tiny"], tmp_path / "without")
    assert r.returncode == 2 and "[hardware] has no option 'site_gpu'" in r.stderr, r.stderr
    r = run_cli(["-cd", str(site / "missing"), "model=tiny"], tmp_path / "missing")
    assert r.returncode == 2 and "[--config-dir]" in r.stderr, r.stderr


def test_config_name_cfg_package_and_resolve(site):
    r = orchestrate("-cd", str(site), "-cn", "site", "--cfg", "job", "--package", "hardware")
    assert r.returncode == 0, r.stderr
    head, _, body = r.stdout.partition("\n")
    assert head == "# @package hardware" and yaml.safe_load(body)["name"] == "site_gpu"
    r = orchestrate("-cd", str(site), "-cn", "site", "--cfg", "job", "layout.tp=2")
    job = yaml.safe_load(r.stdout)
    assert r.returncode == 0 and "hydra" not in job and job["cluster"]["nodes"] == 3 and job["layout"]["tp"] == 2
    r = orchestrate("--cfg", "hydra")
    assert r.returncode == 0 and list(yaml.safe_load(r.stdout)) == ["hydra"], r.stdout[:300]
    r = orchestrate("--cfg", "all", "-p", "hydra.run", "hydra.run.dir=out/${model.name}")
    assert r.returncode == 0 and r.stdout == "# @package hydra.run\ndir: out/${model.name}\n", r.stdout
    r = orchestrate("--cfg", "all", "--resolve", "-p", "hydra.run", "hydra.run.dir=out/${model.name}")
    assert r.returncode == 0 and r.stdout == "# @package hydra.run\ndir: out/llama3_8b\n", r.stdout
    r = orchestrate("--cfg", "job", "layout.tpp=2")  # a bad override is a rejection here too
    assert r.returncode == 2 and "did you mean layout.tp?" in r.stderr, r.stderr
    r = orchestrate("--cfg", "job", "-p", "nowhere")
    assert r.returncode == 2 and "[--package]" in r.stderr, r.stderr


def test_info_help_and_shell_completion(site):
    r = orchestrate("-cd", str(site), "--info", "searchpath")
    assert r.returncode == 0 and f"file://{site}" in r.stdout and "/conf" in r.stdout, r.stdout
    r = orchestrate("--info", "defaults", "model=tiny")
    assert r.returncode == 0 and "model/tiny" in r.stdout and "hardware/h100_sxm" in r.stdout, r.stdout
    r = orchestrate("-cd", str(site), "--help")
    assert r.returncode == 0 and "site_gpu" in r.stdout and "--config-dir, -cd" in r.stdout
    r = orchestrate("--hydra-help")
    assert r.returncode == 0 and "== Flags ==" in r.stdout and "--config-dir,-cd" in r.stdout
    r = orchestrate("-sc", "install=bash")
    assert r.returncode == 0 and "complete -o nospace" in r.stdout
    r = orchestrate("-cd", str(site), "-sc", "query=bash", env={"COMP_LINE": "orchestrate hardware=s"})
    assert r.returncode == 0 and set(r.stdout.split()) == {"hardware=site_gpu"}, r.stdout
    r = orchestrate("-sc")
    assert r.returncode == 2 and "Traceback" not in r.stderr
