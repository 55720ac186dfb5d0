"""A run directory as a thing with a life: its plan, where it stands (and SLURM's word for
its job), how it ended, how to follow it and how to continue it. The `orchestrate-runs`
commands, `launcher.wait=true` and the SLURM supervisor read it here. Following never
changes a run: Ctrl-C detaches.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from orchestrator import rundir
from orchestrator.rundir import EXIT_FAILED, EXIT_OK
from orchestrator.launch.status import read_status, write_status
from orchestrator.rundir import checkpoints as ckpt


def plan_json(run_dir: Path, latest: bool = True) -> dict:
    """The run's plan.json: its latest attempt's (after failovers) or its first. Raises OSError,
    or ValueError for a file that is not a plan the planner wrote (no `config` mapping)."""
    dirs = rundir.attempt_dirs(run_dir)
    path = (dirs[-1] if latest else dirs[0]) / rundir.PLAN_JSON
    try:
        plan = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not JSON ({e})") from None
    if not isinstance(plan, dict) or not isinstance(plan.get("config"), dict):
        raise ValueError(f"{path} holds no plan (no 'config' mapping)")
    return plan


def run_problems(run_dir: Path, resume: bool = False) -> list:
    """Why `run_dir` is not a run directory orchestrate wrote (and, to resume it, one whose
    config can be composed again): a path the file system cannot hold, no plan.json, a plan.json,
    .hydra/overrides.yaml or .hydra/hydra.yaml another program wrote or that is damaged."""
    from omegaconf import OmegaConf

    from orchestrator.config.errors import Problem
    from orchestrator.launch.preflight import path_problems

    fix = "orchestrate-runs list shows the runs (orchestrate-runs list --root DIR for another folder)."
    out = path_problems("run", run_dir)
    if out:
        return out
    run_dir = Path(run_dir)
    if not (run_dir / rundir.PLAN_JSON).is_file():
        return [Problem("run", f"{run_dir} is not a run directory (no plan.json).", fix)]
    for latest in (False, True):
        try:
            plan_json(run_dir, latest)
        except (OSError, ValueError) as e:
            return [Problem("run", f"{run_dir} is not a run directory orchestrate wrote, or it is damaged: "
                            f"{str(e).splitlines()[0]}.", fix)]
    if not resume:
        return []
    hydra = run_dir / rundir.HYDRA_DIR
    try:
        old = OmegaConf.to_container(OmegaConf.load(hydra / "overrides.yaml"))
        if not isinstance(old, list) or not all(isinstance(o, str) for o in old):
            raise ValueError("not a list of overrides")
        if (hydra / "hydra.yaml").exists():
            h = OmegaConf.load(hydra / "hydra.yaml").hydra
            str(h.job.config_name), list(h.runtime.config_sources)
    except Exception as e:  # noqa: BLE001 - any reader's error: the files are not what orchestrate writes
        return [Problem("run", f"{run_dir} cannot be resumed: its {rundir.HYDRA_DIR}/ (the overrides and config "
                        f"sources it was composed with) is missing or damaged ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}).",
                        "resume a run orchestrate started (orchestrate-runs list), or start a new run with "
                        "orchestrate and the overrides you want.")]
    return []


def load_plan(run_dir: Path, latest: bool = True):
    """The run's plan (its latest attempt's, after failovers), planned again from its config."""
    from orchestrator.plan import make_plan

    plan = make_plan(plan_json(run_dir, latest)["config"])
    plan.raise_if_invalid()
    return plan


def continue_command(run_dir: Path) -> str:
    return f"orchestrate-runs resume {run_dir}"


def final_line(run_dir: Path) -> str:
    """One plain line: what happened, the last complete checkpoint, and the command that continues."""
    run_dir = Path(run_dir)
    state_now = state(run_dir)
    status = read_status(run_dir)
    try:
        setting = _at(plan_json(run_dir), "config", "training", "checkpoint", "dir")
        url = ckpt.url_for(setting if isinstance(setting, str) else None, run_dir)
        latest = ckpt.latest_complete(url)
    except (OSError, ValueError):
        url, latest = None, None
    where = (f"last complete checkpoint: step {latest} in {ckpt.step_dir(url, latest)}" if latest is not None else
             "no complete checkpoint")
    what = status.get("message") or _what(run_dir, status, state_now)
    if state_now == "completed":
        return f"COMPLETED: {run_dir} ({what}); {where}."
    if state_now in ("running", "re-forming", "queued", "requeued"):
        return f"{state_now.upper()}: {run_dir}: {what}; {where}"
    return f"{state_now.upper()}: {run_dir}: {what}; {where}; continue with: {continue_command(run_dir)}"


def _what(run_dir: Path, status: dict, now: str) -> str:
    """What a run is doing when its status.json carries no message, said from what it does hold."""
    from orchestrator.launch.status import steps_completed

    try:
        steps = _at(plan_json(run_dir), "config", "training", "steps") or "?"
    except (OSError, ValueError):
        steps = "?"
    done = steps_completed(run_dir, range(10**6))
    job = f" (SLURM job {status['job_id']})" if status.get("job_id") else ""
    if now == "queued":
        return f"waiting in the queue{job}, nothing has run yet" if not done else f"waiting in the queue{job}"
    if now in ("running", "re-forming"):
        doing = "re-forming after a failure" if now == "re-forming" else "training"
        nodes = len(status["nodes"]) if isinstance(status.get("nodes"), list) else "?"
        return (f"attempt {status.get('attempt', 0)}{job} {doing} on {nodes} node(s), layout "
                f"{status.get('layout', '?')}: step {done} of {steps} done")
    return f"{now}{job} after step {done} of {steps}, with no reason recorded (see failover.json and the logs)"


def find_runs(root: Path) -> list[Path]:
    """Run directories under root (each holds a plan.json and a status.json), newest first."""
    root = Path(root)
    found = {p.parent for p in root.rglob(rundir.STATUS_JSON) if (p.parent / rundir.PLAN_JSON).exists()}
    return sorted(found, key=lambda p: (p / rundir.STATUS_JSON).stat().st_mtime, reverse=True)


def summary(run_dir: Path) -> dict:
    """One row of `orchestrate-runs list`: state, layout, progress, loss, predicted vs measured step
    (the latest attempt's, rundir.measured_step_s)."""
    from orchestrator.launch.status import read_metrics

    run_dir = Path(run_dir)
    pj = plan_json(run_dir)
    metrics = [m for m in read_metrics(run_dir) if isinstance(m.get("step"), int)]
    steps = rundir.last_attempt_times(run_dir)
    loss = metrics[-1].get("loss") if metrics else None
    return {"run": str(run_dir), "state": state(run_dir), "launcher": _at(pj, "config", "launcher", "name") or "-",
            "layout": _at(pj, "layout", "label") or "-",
            "steps": f"{max((m['step'] + 1 for m in metrics), default=0)}/{_at(pj, 'config', 'training', 'steps')}",
            "loss": loss if isinstance(loss, (int, float)) else None,
            "predicted_step_s": _at(pj, "step", "wall_s"),
            "measured_step_s": rundir.measured_step_s(steps) if steps else None}


def _at(d, *keys):
    """d[k1][k2]..., or None where a level is missing or not a mapping (a plan from another version)."""
    for k in keys:
        d = d.get(k) if isinstance(d, dict) else None
    return d


def code_drift(run_dir: Path) -> list[str]:
    """How the code and the packages now differ from what the run's manifest recorded."""
    from orchestrator.launch.manifest import manifest

    try:
        then = json.loads((Path(run_dir) / rundir.RUN_MANIFEST).read_text())
    except (OSError, ValueError):
        then = None
    if not isinstance(then, dict) or not isinstance(then.get("code", {}), dict) \
            or not isinstance(then.get("versions", {}), dict):
        return ["the run has no readable manifest.json: what produced it is unknown"]
    now = manifest([])
    out = []
    a, b = then.get("code", {}), now.get("code", {})
    if a.get("git") != b.get("git"):
        out.append(f"code: the run was submitted at commit {a.get('git')}, this checkout is at {b.get('git')}")
    elif a.get("diff") != b.get("diff"):
        out.append("code: the uncommitted changes differ from the ones the run was submitted with")
    for name, version in then.get("versions", {}).items():
        if now["versions"].get(name) != version:
            out.append(f"{name}: the run had {version}, this environment has {now['versions'].get(name)}")
    return out


def show_status(run_dir: Path) -> int:
    from orchestrator.rundir.events import read_events

    row = summary(run_dir)
    status = read_status(run_dir)
    print(f"run       {run_dir}\nstate     {state(run_dir)}" + (f" ({status['message']})" if status.get("message") else ""))
    for key in ("launcher", "layout", "steps", "loss", "predicted_step_s", "measured_step_s"):
        print(f"{key:<9} {row[key]}")
    for key in ("job_id", "attempt", "nodes"):
        if key in status:
            print(f"{key:<9} {status[key]}")
    control = status.get("control")
    if isinstance(control, dict) and control.get("dropped_total"):  # control messages refused (launch/control.py)
        print(f"control   {control['dropped_total']} message(s) dropped: {control.get('dropped')}")
    for s in status.get("stragglers") or []:  # launch/stragglers.py
        if isinstance(s, dict):
            print(f"straggler {s.get('what')}")
    for e in read_events(run_dir):
        print(f"event     {e.get('mode')}: " + ", ".join(f"{k}={e[k]}" for k in ("nodes_lost", "steps_lost", "recovery_s",
                                                                                 "resumed_from_step") if k in e))
    print(final_line(run_dir))
    return 0


def show_logs(run_dir: Path, keep_following: bool) -> int:
    if keep_following:
        return follow(run_dir)
    tail = Tail()
    for path, prefix in _files(run_dir):
        tail(path, prefix)
    return 0


def cancel(run_dir: Path) -> int:
    import os
    import signal

    status = read_status(run_dir)
    job = last_job(run_dir)
    if job is not None:
        try:
            r = subprocess.run(["scancel", str(job["job_id"])], check=False, timeout=60, capture_output=True, text=True)
            failed = f"exit status {r.returncode}: {(r.stderr.strip().splitlines() or [''])[-1]}" if r.returncode else ""
        except (OSError, subprocess.TimeoutExpired) as e:
            failed = f"{type(e).__name__}: {e}"
        if failed:  # the run's status is left as it is: the job may still run
            print(f"scancel {job['job_id']} failed ({failed}): the job may still run", file=sys.stderr)
            return EXIT_FAILED
        write_status(run_dir, state="cancelled", message=f"cancelled by the user (SLURM job {job['job_id']})")
        print(f"cancelled SLURM job {job['job_id']}")
        return 0
    pid = status.get("pid")
    if pid and status.get("state") in ("running", "re-forming"):
        if not (isinstance(pid, int) and pid > 1 and _alive(pid)):  # never a pid that is not a live orchestrator
            print(f"{run_dir}: its launcher (pid {pid!r}) is not running: nothing to cancel")
            return 0
        try:
            os.kill(pid, signal.SIGTERM)  # the local launcher stops its ranks, then exits
        except ProcessLookupError:
            pass
        write_status(run_dir, state="cancelled", message="cancelled by the user")
        print(f"stopped the local launcher (pid {pid}) and its ranks")
        return 0
    print(f"{run_dir} is not running ({status.get('state', 'unknown')}): nothing to cancel")
    return 0


def resume_overrides(run_dir: Path, extra: list[str]) -> list[str]:
    """The run's own overrides, then the new ones, into the same run directory."""
    from omegaconf import OmegaConf

    path = Path(run_dir) / rundir.HYDRA_DIR / "overrides.yaml"
    old = list(OmegaConf.load(path)) if path.exists() else []
    keys = {o.split("=", 1)[0] for o in extra}
    kept = [o for o in old if o.split("=", 1)[0] not in keys and not o.startswith("hydra.run.dir=")]
    return kept + list(extra) + [f"hydra.run.dir={run_dir}"]


def resume_sources(run_dir: Path) -> dict:
    """The primary config and the --config-dir the run was composed with (.hydra/hydra.yaml)."""
    from omegaconf import OmegaConf

    path = Path(run_dir) / rundir.HYDRA_DIR / "hydra.yaml"
    if not path.exists():
        return {}
    h = OmegaConf.load(path).hydra
    extra = [s.path for s in h.runtime.config_sources if s.provider == "command-line" and s.schema == "file"]
    return {"config_name": h.job.config_name, "config_dir": extra[0] if extra else None}


# ---- following -------------------------------------------------------------------------------
DONE = ("completed", "failed", "stopped", "cancelled")
SLURM_ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "NODE_FAIL",
               "PREEMPTED")


def last_job(run_dir: Path) -> dict | None:
    path = Path(run_dir) / rundir.SLURM_JOBS
    if not path.exists():
        return None
    jobs = [j for j in rundir.read_jsonl(path) if isinstance(j.get("job_id"), (str, int)) and j.get("folder")]
    return jobs[-1] if jobs else None  # a line another program wrote names no job of this run


def slurm_state(job_id: str) -> str | None:
    try:
        out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", str(job_id), "-o", "State"], capture_output=True,
                             text=True, timeout=30).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return out[0].split()[0] if out else None


def state(run_dir: Path) -> str:
    """Where the run stands. A job SLURM says has ended while its status still says it runs
    ended without its supervisor (cancelled, or its node lost): that is said plainly."""
    status = read_status(run_dir)
    current = status.get("state")
    current = current if isinstance(current, str) and current else "unknown"
    job = last_job(run_dir)
    if current not in DONE and status.get("launcher") == "local" and status.get("pid") and not _alive(status["pid"]):
        new_msg = (f"the supervisor (orchestrate, pid {status['pid']}) is gone, killed or its machine lost, while the "
                   f"run was {current}" + (f" ({status['message']})" if status.get("message") else "") +
                   "; its ranks died with it")
        write_status(run_dir, state="failed", message=new_msg, supervisor_lost=status["pid"])
        return "failed"
    if current in DONE or job is None:
        return current
    sl = slurm_state(job["job_id"])
    if sl in SLURM_ENDED:
        new = "cancelled" if sl == "CANCELLED" else "failed"
        write_status(run_dir, state=new, message=f"SLURM job {job['job_id']} ended {sl} while the run was {current}")
        return new
    if sl == "PENDING" and current == "requeued":
        return "requeued"
    return current


def _alive(pid: int) -> bool:
    """A process that exists, is not a zombie, and is an orchestrator (a reused pid is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return False
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"orchestrat" in f.read()
    except (OSError, IndexError):
        return False


class Tail:
    """New lines of a few files, remembered by position."""

    def __init__(self):
        self.pos: dict[str, int] = {}

    def __call__(self, path: Path, prefix: str, out=print) -> None:
        if not path.exists():
            return
        with open(path, errors="replace") as f:
            f.seek(self.pos.get(str(path), 0))
            for line in f:
                out(prefix + rundir.rank_message(line.rstrip("\n")), flush=True)
            self.pos[str(path)] = f.tell()


def _files(run_dir: Path) -> list[tuple[Path, str]]:
    status = read_status(run_dir)
    out = []
    job = last_job(run_dir)
    if job:
        out.append((Path(job["folder"]) / f"{job['job_id']}_0_log.out", "[supervisor] "))
    plan_dir = Path(status.get("plan_dir", run_dir))
    out.append((rundir.rank_log(plan_dir, 0), "[rank0] "))
    return out


def follow(run_dir: Path, poll_s: float = 2.0, out=print) -> int:
    """Print the run's progress until it ends; 0 if it completed. Ctrl-C detaches."""
    run_dir = Path(run_dir)
    tail = Tail()
    try:
        while True:
            for path, prefix in _files(run_dir):
                tail(path, prefix, out)
            now = state(run_dir)
            if now in DONE:
                for path, prefix in _files(run_dir):
                    tail(path, prefix, out)
                out(final_line(run_dir), flush=True)
                return EXIT_OK if now == "completed" else EXIT_FAILED
            time.sleep(poll_s)
    except KeyboardInterrupt:
        job = last_job(run_dir)
        print("\ndetached: the run goes on" + (f" (SLURM job {job['job_id']})" if job else "") +
              f"; follow again with: orchestrate-runs logs -f {run_dir}", file=sys.stderr)
        return EXIT_OK


def wait_for(run_dir: Path, poll_s: float = 2.0) -> str:
    """Block until the run ends; its final state."""
    while (now := state(run_dir)) not in DONE:
        time.sleep(poll_s)
    return now
