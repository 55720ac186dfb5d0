import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def plan_of(*overrides: str):
    """Compose like the command line and plan (in process, no run directory)."""
    from orchestrator import compose, make_plan

    return make_plan(compose(list(overrides)))


def run_cli(args: list[str], tmp_path: Path, env: dict | None = None, timeout: int = 120):
    """Run `python -m orchestrator` for real; the run directory goes under tmp_path."""
    cmd = [sys.executable, "-m", "orchestrator", *args, f"hydra.run.dir={tmp_path}/run",
           f"hydra.sweep.dir={tmp_path}/sweep"]
    e = dict(os.environ, **(env or {}))
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=e)


@pytest.fixture
def cli(tmp_path):
    def _run(*args, **kw):
        return run_cli(list(args), tmp_path, **kw)

    _run.dir = tmp_path / "run"
    return _run
