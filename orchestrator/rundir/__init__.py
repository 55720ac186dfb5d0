"""The run directory and the launch contract, in one place: every file and folder name, the
attempt directories, the environment a launcher gives the runtime, the exit statuses both
sides read, the one rule for "the measured step", and how JSON is written (strict: no NaN or
Infinity). Launchers, the runtime, the sweep and `orchestrate-runs` all use these names.
Torch-free and free of the rest of orchestrator, so every layer may import it. Its modules:
`checkpoints` (save folders, files.json, COMPLETE/DAMAGED, what a resume may change),
`events` (failover.json and its TensorBoard copy), `metrics` (measured MFU, one row per attempt),
`plan` (an attempt's plan.json as the runtime reads it, typed: the one module here that reads
orchestrator.config, for its schema).

    RUN_DIR/                     attempt 0 is the run directory itself
      plan.json  plan.md  cluster.png  step_budget.png   what the planner wrote
      .hydra/  manifest.json     what produced the run (config, overrides, command, code)
      status.json                where the run stands (orchestrate-runs reads it)
      metrics.jsonl              every step of every attempt (rank 0); metrics.json: the last attempt
      failover.json              what every failover did
      logs/<name>.log  tensorboard/  samples/rank<N>.jsonl  checkpoints/step_NNNNNNNN/
      progress/<host>.<pid>      each live rank's last beat (the launchers' hang deadline)
      slurm/  slurm_jobs.jsonl   submitit's folder; every SLURM job of the run
      control.key                the job's control secret (0600)
      lease/holder.json gen<N>   which supervisor holds the run (generation N), last renewed when
      attempt<N>/                a re-planned attempt's plan.json (and its logs/)
"""
from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import Any

# ---- file and folder names ----------------------------------------------------------------
PLAN_JSON, PLAN_MD = "plan.json", "plan.md"
CLUSTER_PNG, STEP_BUDGET_PNG = "cluster.png", "step_budget.png"
METRICS_JSONL, METRICS_JSON = "metrics.jsonl", "metrics.json"
PROFILE_JSON = "profile.json"  # one profiled step split into the predicted parts (train/profile.py)
FAILOVER_JSON, STATUS_JSON = "failover.json", "status.json"
RUN_MANIFEST = "manifest.json"  # the run's: command, code, versions (a save's file list: checkpoints.FILES_JSON)
SWEEP_JSON, SLURM_JOBS = "sweep.json", "slurm_jobs.jsonl"
REQUEUES_JSON = "requeues.json"  # SLURM: how many times the job requeued itself (launch/srun.py)
HYDRA_DIR, LOGS, TENSORBOARD, CHECKPOINTS, SAMPLES = ".hydra", "logs", "tensorboard", "checkpoints", "samples"
PROGRESS = "progress"  # progress/<host>.<pid>: each rank's last beat (train/world.beat, launch/progress.py)
KEEPERS = "keepers"  # keepers/<node>.json: where each node's snapshot keeper listens (SLURM; launch/keepers.py)
SLURM_DIR = "slurm"  # submitit's folder (batch scripts, the supervisor's output); a sweep's: slurm/group<N>/
CONTROL_KEY = "control.key"  # the job's control secret (train/wire.py), 0600
ATTEMPT = "attempt"  # attempt<N>/
LEASE, LEASE_HOLDER = "lease", "holder.json"  # lease/holder.json + lease/gen<N>: the supervisor's (launch/lease.py)


def log_file(plan_dir: Path, name: str) -> Path:
    """A process's log in an attempt's directory: logs/<name>.log."""
    return Path(plan_dir) / LOGS / f"{name}.log"


def rank_log(plan_dir: Path, rank: int) -> Path:
    """A rank's log in an attempt's directory: logs/rank<N>.log."""
    return log_file(plan_dir, f"rank{rank}")

# ---- the environment a launcher gives every rank --------------------------------------------
ENV_RUN_DIR = "ORCH_RUN_DIR"  # the run directory (outputs shared by every attempt); default: the plan's dir
ENV_ATTEMPT = "ORCH_ATTEMPT"  # the attempt number
ENV_STORE = "ORCH_STORE"  # host:port of each shard of the job's TCP store, comma-separated (store_shards)
ENV_CONTROL = "ORCH_CONTROL"  # the coordinator's address (copies of the state, in-place failover)
ENV_JOIN_COPY = "ORCH_JOIN_COPY"  # a warm spare or a returning node joins as this copy
ENV_JOIN_NOW = "ORCH_JOIN_NOW"  # "1": join at once instead of at the next generation
ENV_FORK_SERVER = "ORCH_FORK_SERVER"  # "0": one interpreter per rank instead of the fork server
# (fault injection, fault.*, travels in plan.json: the rank reads it there, rundir/plan.py)
ENV_JOB = "ORCH_JOB"  # the job's prefix for every key of the (unauthenticated) store


RANKS_PER_STORE_SHARD = 4096  # the job's store runs one shard (a TCPStore server) per this many ranks


def store_shards(world_size: int, override: int | None = None) -> int:
    """How many shards the job's store runs (failover.store_shards, or one per RANKS_PER_STORE_SHARD
    ranks): a generation's groups are rebuilt on all of them at once (train/replicas.py)."""
    if override:
        return max(1, int(override))
    return max(1, math.ceil(world_size / RANKS_PER_STORE_SHARD))


def store_shard(index: int, shards: int) -> int:
    """The shard that holds every key of group `index` (a copy's own world: its copy number; a
    cross-copy group: its position in the copy): the same in every process (no per-process hash),
    and consecutive groups on consecutive shards, so a rebuild spreads over min(groups, shards)."""
    return index % shards


def store_addresses(value: str) -> list[str]:
    """ENV_STORE's shards, in shard order."""
    return [a for a in value.split(",") if a]


def abort_key(gen: int) -> str:
    """The store key (under the job's prefix) the coordinator sets when generation `gen`'s
    cross-copy collectives are to be abandoned (launch/control.py; train/replicas.py watches it):
    its value names the copies lost, as JSON."""
    return f"abort/gen{gen}"
ENV_CONTROL_KEY_FILE = "ORCH_CONTROL_KEY_FILE"  # the file holding the job's control secret (0600)
ENV_HOSTS = "ORCH_HOSTS"  # SLURM: the host of each logical node, in the plan's order (placement)
ENV_PLAN = "ORCH_PLAN"  # external trainers: this attempt's plan.json

# ---- exit statuses (the CLI's, and the ones the runtime and the supervisors agree on) --------
EXIT_OK, EXIT_FAILED, EXIT_REJECTED = 0, 1, 2  # rejected: the config was refused, nothing launched
EXIT_STOPPED = 3  # the run saved and stopped on request; it continues from its checkpoint
EXIT_NO_CHECKPOINT = 4  # every complete checkpoint is damaged: the run stops and says so
EXIT_LEFT = 5  # a copy the coordinator dismissed (not part of the next generation)
EXIT_INCOMPLETE = 6  # every rank ended, with steps missing (a failover path that ended the run early)
EXIT_NO_PROGRESS = 7  # attempts kept failing at the same step: a requeue would do the same
EXIT_FENCED = 8  # a standby supervisor took the run's lease (launch/lease.py): this one stepped down
EXIT_INTERRUPTED, EXIT_PIPE = 130, 141  # Ctrl-C; the output pipe was closed


class RankExit(Exception):
    """The runtime ends this rank with `status` (one of the EXIT_* above): raised where the
    reason is known, turned into the exit status only at the rank's entry point (train/worker.py)."""

    def __init__(self, status: int, message: str = ""):
        super().__init__(message or f"exit status {status}")
        self.status, self.message = status, message


def exit_now(status: int) -> None:
    """End this process with `status` as a normal exit would, less the interpreter's teardown: the
    exit functions run (logging's flush, torch's) and a collection, then os._exit. The teardown
    (C++ static destructors, a store's or gloo's threads ended while a late signal lands) can abort
    a rank that finished its work ('terminate called without an active exception', status 134),
    and its status is what the launchers read (SLURM requeues on it). The ranks' one way out
    (train/worker.py's entry point, launch/forkserver.py's children)."""
    import atexit
    import gc
    import os
    import sys

    try:
        atexit._run_exitfuncs()
        gc.collect()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(status)


# ---- rank log lines -------------------------------------------------------------------------
RANK_LOG_FORMAT = "[rank {rank}] %(levelname)s %(message)s"  # logs/rank<N>.log, one line a record
_RANK_PREFIX = re.compile(r"^\[rank \d+\] (?:INFO )?")


def rank_message(line: str) -> str:
    """A rank log line without its rank prefix (and level, when INFO): what the console echoes
    after its own [node rank] prefix, and what launchers match ("step ", "resumed from")."""
    return _RANK_PREFIX.sub("", line, count=1)


# ---- attempts -------------------------------------------------------------------------------
def attempt_dir(run_dir: Path, attempt: int) -> Path:
    """Where attempt N's plan lives: the run directory for attempt 0, else attempt<N>/."""
    return Path(run_dir) if attempt == 0 else Path(run_dir) / f"{ATTEMPT}{attempt}"


def make_attempt_dir(run_dir: Path, attempt: int) -> Path:
    d = attempt_dir(run_dir, attempt)
    d.mkdir(parents=True, exist_ok=True)
    return d


def attempt_number(plan_dir: Path, run_dir: Path) -> int | None:
    """The attempt a plan directory of `run_dir` holds: 0 for the run directory itself, N for
    attempt<N>/, None for any other folder. The one place an attempt number is read back."""
    plan_dir = Path(plan_dir)
    if plan_dir.resolve() == Path(run_dir).resolve():
        return 0
    m = re.fullmatch(rf"{ATTEMPT}(\d+)", plan_dir.name)
    return int(m.group(1)) if m and plan_dir.parent.resolve() == Path(run_dir).resolve() else None


def run_dir_of(plan_dir: Path) -> Path:
    """The run directory of a plan directory: RUN_DIR itself, or RUN_DIR for RUN_DIR/attempt<N>."""
    plan_dir = Path(plan_dir)
    return plan_dir.parent if re.fullmatch(rf"{ATTEMPT}\d+", plan_dir.name) else plan_dir


def attempt_of(plan_dir: Path) -> int:
    """The attempt a plan directory holds, from its path alone: N for .../attempt<N>, else 0."""
    return attempt_number(plan_dir, run_dir_of(plan_dir)) or 0


def attempt_dirs(run_dir: Path) -> list[Path]:
    """The directory of every attempt's plan, oldest first (the run dir is attempt 0)."""
    run_dir = Path(run_dir)
    later = [(attempt_number(p, run_dir), p) for p in run_dir.glob(f"{ATTEMPT}*") if (p / PLAN_JSON).exists()]
    return [run_dir] + [p for n, p in sorted(x for x in later if x[0])]


def attempt_plan_path(run_dir: Path, attempt: int) -> Path:
    """The plan an attempt ran: attempt<N>/plan.json after a failover re-plan, else the run's."""
    p = attempt_dir(run_dir, attempt) / PLAN_JSON
    return p if p.exists() else Path(run_dir) / PLAN_JSON


# ---- metrics and the measured step --------------------------------------------------------
WARMUP_STEPS = 1  # each attempt's first step (compilation, allocator, first collectives) is not measured


def read_jsonl(path: Path) -> list[dict]:
    """Every complete line of a JSON-lines file (a line being written is skipped)."""
    out = []
    if Path(path).exists():
        for line in Path(path).read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):  # a line that is not a record (another program's) is skipped too
                out.append(record)
    return out


def read_steps(run_dir: Path, latest: bool = True) -> list[dict]:
    """Every step a run finished: metrics.jsonl, or metrics.json when there is no jsonl. Each:
    step, step_time_s, attempt, loss. With `latest`, a step re-run after a failover counts once,
    from its latest attempt (the steps that count); without, every attempt's steps (what ran)."""
    run_dir = Path(run_dir)
    if (run_dir / METRICS_JSONL).exists():
        every = [r for r in read_jsonl(run_dir / METRICS_JSONL) if _step_record(r)]
        by_step: dict[int, dict] = {}
        for rec in every:
            step = int(rec.get("step", len(by_step)))
            if step not in by_step or rec.get("attempt", 0) >= by_step[step].get("attempt", 0):
                by_step[step] = rec
        return [by_step[s] for s in sorted(by_step)] if latest else every
    if (run_dir / METRICS_JSON).exists():
        try:
            m = json.loads((run_dir / METRICS_JSON).read_text())
        except (OSError, ValueError):
            return []
        if not (isinstance(m, dict) and isinstance(m.get("start_step", 0), int) and isinstance(m.get("attempt", 0), int)
                and isinstance(m.get("step_time_s") or [], list) and isinstance(m.get("loss") or [], list)):
            return []  # not what the runtime writes
        start, attempt, loss = int(m.get("start_step", 0)), int(m.get("attempt", 0)), m.get("loss") or []
        return [{"step": start + i, "step_time_s": t, "attempt": attempt, "loss": loss[i] if i < len(loss) else None}
                for i, t in enumerate(m.get("step_time_s") or [])]
    return []


def _step_record(r: dict) -> bool:
    """A metrics.jsonl record of a finished step, as the runtime writes it (another line is skipped)."""
    t = r.get("step_time_s")
    return isinstance(t, (int, float)) and not isinstance(t, bool) and isinstance(r.get("step", 0), int) \
        and isinstance(r.get("attempt", 0), int)


PROFILED = "profiled"  # a metrics.jsonl record's flag: the step ran under the profiler (or its warm-up)


def timed(records: list[dict]) -> list[dict]:
    """The step records whose times count: the profiled ones left out (unless nothing else is left)."""
    return [r for r in records if not r.get(PROFILED)] or list(records)


def measured(times: list[float], warmup: int = WARMUP_STEPS) -> list[float]:
    """The step times that count for one attempt: its first `warmup` left out when more remain."""
    return list(times[warmup:]) if len(times) > warmup else list(times)


def measured_step_s(times: list[float], warmup: int = WARMUP_STEPS) -> float:
    """The measured step of one attempt: the median of its steps after the warm-up."""
    import statistics  # (fractions, decimal: not on the planning path)

    if not times:
        raise ValueError("no measured step times")
    return statistics.median(measured(times, warmup))


def last_attempt_times(run_dir: Path) -> list[float]:
    """The step times of the run's latest measured attempt, in the order they ran."""
    every = read_steps(run_dir, latest=False)
    last = max((int(r.get("attempt", 0)) for r in every), default=0)
    return [float(r["step_time_s"]) for r in timed([r for r in every if int(r.get("attempt", 0)) == last])]


# ---- JSON -----------------------------------------------------------------------------------
def strict(obj: Any) -> Any:
    """`obj` with every non-finite float (inf, nan) as None, numpy scalars as Python numbers:
    what strict JSON can hold. A null figure in plan.json means "unbounded or undefined"
    (e.g. blast_radius.job_mtbf_hours with hardware.failures_per_gpu_hour=0: no failure expected)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict(v) for v in obj]
    if hasattr(obj, "item") and not isinstance(obj, (str, bytes)):  # numpy scalars
        return strict(obj.item())
    return obj


def dumps(obj: Any, indent: int | None = 1, default=None) -> str:
    """Strict JSON text (json.dumps with allow_nan=False; `strict` first where it is needed)."""
    try:
        return json.dumps(obj, indent=indent, allow_nan=False, default=default or _plain)
    except ValueError:  # a non-finite float somewhere
        return json.dumps(strict(obj), indent=indent, allow_nan=False, default=default)


def _plain(x: Any) -> Any:
    if hasattr(x, "item"):  # numpy scalars (a non-finite one is caught as json.dumps raises)
        v = x.item()
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError("non-finite")
        return v
    raise TypeError(f"not JSON serialisable: {type(x)}")


def write_json(path: Path, obj: Any, indent: int | None = 1, default=None) -> Path:
    """Strict JSON, written whole and then renamed: a reader never sees half a file."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{time.monotonic_ns()}.tmp")
    tmp.write_text(dumps(obj, indent, default) + "\n")
    tmp.replace(path)
    return path
