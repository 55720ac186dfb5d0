"""What produced a run, written before anything starts: the config (Hydra's own .hydra/
files) and manifest.json (command line, git commit and uncommitted changes, versions)."""
from __future__ import annotations

import json
import os
import platform
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

from orchestrator import rundir

PACKAGES = ("torch", "hydra-core", "omegaconf", "submitit", "fsspec", "tensorboard", "numpy",
            "nvidia-nccl-cu12", "nvidia-cuda-runtime-cu12")


def write_config(run_dir: Path, cfg, overrides: list[str], argv: list[str]) -> None:
    """.hydra/config.yaml and overrides.yaml as Hydra writes them, hydra.yaml with the keys that
    say where the config came from (hydra.job.config_name, hydra.runtime.config_sources: a
    --config-dir is one of them), and manifest.json."""
    from omegaconf import OmegaConf, open_dict

    hydra_dir = Path(run_dir) / rundir.HYDRA_DIR
    hydra_dir.mkdir(parents=True, exist_ok=True)
    job = cfg.copy()
    with open_dict(job):
        job.pop("hydra", None)
    (hydra_dir / "config.yaml").write_text(OmegaConf.to_yaml(job))
    (hydra_dir / "overrides.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(list(overrides))))
    if "hydra" in cfg:
        sources = {"job": {"config_name": cfg.hydra.job.config_name},
                   "runtime": {"config_sources": OmegaConf.to_container(cfg.hydra.runtime.config_sources)}}
        (hydra_dir / "hydra.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create({"hydra": sources})))
    rundir.write_json(Path(run_dir) / rundir.RUN_MANIFEST, manifest(argv))


def installed_versions(names) -> dict[str, str]:
    """The installed version of each named distribution, from its `NAME-VERSION.dist-info` (or
    .egg-info) folder name on sys.path, the first found winning as for an import: what
    importlib.metadata.version answers, without its import (a fifth of a dry run's own time)."""
    want = {re.sub(r"[-_.]+", "_", n).lower(): n for n in names}
    out: dict[str, str] = {}
    for entry in sys.path:
        try:
            items = os.scandir(entry or ".")
        except OSError:
            continue
        with items:
            for d in items:
                m = re.match(r"(.+?)-([^-]+?)(?:-py[0-9.]+)?\.(?:dist|egg)-info$", d.name)
                if m:
                    name = want.get(re.sub(r"[-_.]+", "_", m.group(1)).lower())
                    if name is not None and name not in out:
                        out[name] = m.group(2)
    return {n: out[n] for n in names if n in out}


def manifest(argv: list[str]) -> dict:
    versions = {"python": platform.python_version(), **installed_versions(PACKAGES)}
    return {"command": ["orchestrate", *argv], "cwd": str(Path.cwd()), "host": socket.gethostname(),
            "time": time.time(), "versions": versions, "code": code_state(Path(__file__).resolve().parents[2])}


def code_state(root: Path) -> dict:
    """The git commit and the uncommitted diff of the code that runs, or why there is none
    (the three git commands run side by side: a dry run waits for the slowest, not the sum)."""
    args = {"commit": ["rev-parse", "HEAD"], "diff": ["diff", "HEAD"],
            "untracked": ["ls-files", "--others", "--exclude-standard"]}
    procs: dict = {}
    try:
        for k, a in args.items():
            procs[k] = subprocess.Popen(["git", "-C", str(root), *a], stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, text=True)
        out = {k: p.communicate(timeout=20)[0] for k, p in procs.items()}
        if any(p.returncode for p in procs.values()):
            raise subprocess.SubprocessError("git failed")
    except (OSError, subprocess.SubprocessError):
        for p in procs.values():
            p.kill()
            p.wait()
        return {"git": None, "note": f"not a git checkout ({root}): an installed package of "
                f"orchestrator {_own_version()}"}
    diff, untracked = out["diff"], out["untracked"].split()
    return {"git": out["commit"].strip(), "dirty": bool(diff or untracked), "diff": diff, "untracked": untracked}


def _own_version() -> str:
    return installed_versions(["orchestrator"]).get("orchestrator", "(unknown version)")


def record_attempt(run_dir: Path, attempt: int, plan_dir: Path, hosts: list) -> None:
    """Append where an attempt ran to manifest.json: its SLURM job (when under SLURM), hosts, plan."""
    path = Path(run_dir) / rundir.RUN_MANIFEST
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    data.setdefault("attempts", []).append({
        "attempt": attempt, "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "slurm_restart_count": os.environ.get("SLURM_RESTART_COUNT"), "hosts": [str(h) for h in hosts],
        "supervisor_host": socket.gethostname(), "plan_dir": str(plan_dir), "time": time.time()})
    rundir.write_json(path, data)
