"""`orchestrate-runs` on a local run: list, status, logs, cancel and resume, end to end.

A run is started in the background, cancelled once it has saved a checkpoint, found by
`list`, explained by `status`, and continued by `resume` with its own configuration; the
continued run's losses are the uninterrupted run's."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, losses_by_step

COMMON = ["hardware=cpu", "model=tiny", "launcher=local", "figures=false", "cluster.nodes=1",
          "hardware.gpus_per_node=2", "layout.dp=2", "training.steps=20", "training.checkpoint.every=2"]


def runs(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from orchestrator.cli import runs_main; runs_main()", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_a_cancelled_local_run_is_listed_explained_and_resumed(tmp_path, tiny_losses):
    uninterrupted = tiny_losses

    run = tmp_path / "outputs" / "mine"
    p = subprocess.Popen([sys.executable, "-m", "orchestrator", *COMMON, f"hydra.run.dir={run}"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not (run / "checkpoints" / "step_00000004" / "COMPLETE").exists():
        time.sleep(0.2)
    from test_robustness import _ranks_of

    ranks = _ranks_of(p.pid)
    assert len(ranks) == 2, ranks
    for pid in ranks:  # held where they are: the cancel cannot lose a race with the run's last steps
        os.kill(pid, signal.SIGSTOP)  # (the launcher's SIGKILL ends a stopped process)
    r = runs("cancel", str(run))
    assert r.returncode == 0 and "stopped the local launcher" in r.stdout, r.stdout + r.stderr
    p.communicate(timeout=60)
    done = max(losses_by_step(run))
    assert done < 19  # it was stopped before the end

    r = runs("list", "--root", str(tmp_path / "outputs"))
    (row,) = [line for line in r.stdout.splitlines() if str(run) in line]
    assert row.split()[0] == "cancelled" and "TP1 CP1 PP1 DP2" in row and f"{done + 1}/20" in row

    r = runs("status", str(run))
    assert r.returncode == 0
    assert "CANCELLED" in r.stdout and "last complete checkpoint: step" in r.stdout
    assert f"continue with: orchestrate-runs resume {run}" in r.stdout

    r = runs("logs", str(run))
    assert "step 1/20" in r.stdout

    r = runs("resume", str(run))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "resumed from" in r.stdout
    assert json.loads((run / "status.json").read_text())["state"] == "completed"
    got = losses_by_step(run)
    assert sorted(got) == list(range(20))
    for step in range(20):  # steps after the checkpoint were re-done by the resumed attempt
        assert got[step] == pytest.approx(uninterrupted[step], rel=1e-5), step
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["command"][:3] == ["orchestrate-runs", "resume", str(run)] or manifest["command"][0] == \
        "orchestrate"
    assert [a["attempt"] for a in manifest["attempts"]] and all(a["hosts"] for a in manifest["attempts"])

    r = runs("status", str(tmp_path))
    assert r.returncode == 2 and "not a run directory" in r.stderr and "Traceback" not in r.stderr
