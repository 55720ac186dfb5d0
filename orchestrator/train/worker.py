"""One rank of a training job: `python -m orchestrator.train.worker PLAN_DIR`.

The usual torch environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT),
or SLURM's for a task started by srun, says where this rank is; PLAN_DIR/plan.json
says everything else (train/trainer.py). SIGUSR2 (preemption, time limit) makes every
rank save at the next step boundary and exit with EXIT_STOPPED; so does SIGTERM, which
SLURM sends first when it preempts a job.

The rank logs through `logging` (logger "orchestrator", set up here once): one line a record,
`[rank N] LEVEL message`, on stdout, which the launchers write to logs/rank<N>.log (the local
launcher's pipe, srun's --output). A rank ends with an exit status only here: what stops it
inside raises rundir.RankExit; it leaves through rundir.exit_now (no interpreter teardown).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

from orchestrator import rundir
from orchestrator.rundir import EXIT_LEFT, EXIT_OK, EXIT_STOPPED, RankExit
from orchestrator.train.trainer import Trainer

log = logging.getLogger("orchestrator.train.worker")  # not __name__: "__main__" under python -m

SLURM_ENV = {"RANK": "SLURM_PROCID", "WORLD_SIZE": "SLURM_NTASKS", "LOCAL_RANK": "SLURM_LOCALID",
             "GROUP_RANK": "SLURM_NODEID"}


def train(plan_dir: Path, should_stop=None) -> dict:
    """Train on the plan in plan_dir. `should_stop()` is polled at every step boundary;
    when any rank says so, all save a checkpoint and return."""
    return Trainer(plan_dir, should_stop).run()


def rank_from_host() -> str | None:
    """Under srun: SLURM numbers tasks in its own node order; the launcher's placement
    (ORCH_HOSTS, the host of each logical node) says which logical node this host is.
    What was decided, to log (None: nothing to place)."""
    hosts, me = os.environ.get(rundir.ENV_HOSTS, "").split(","), os.environ.get("SLURMD_NODENAME")
    if me not in hosts or "SLURM_LOCALID" not in os.environ or "SLURM_NTASKS" not in os.environ:
        return None
    k, per = hosts.index(me), int(os.environ["SLURM_NTASKS"]) // len(hosts)
    os.environ.update(RANK=str(k * per + int(os.environ["SLURM_LOCALID"])), GROUP_RANK=str(k))
    return f"placement: rank {os.environ['RANK']} is logical node {k} on {me}"


def setup_logging(rank: str) -> None:
    """The rank's one logging setup: records of every orchestrator module, INFO and up, to stdout."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(rundir.RANK_LOG_FORMAT.format(rank=rank)))
    root = logging.getLogger("orchestrator")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    root.propagate = False


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m orchestrator.train.worker PLAN_DIR")
    placed = rank_from_host()
    for torch_name, slurm_name in SLURM_ENV.items():
        if torch_name not in os.environ and slurm_name in os.environ:
            os.environ[torch_name] = os.environ[slurm_name]
    setup_logging(os.environ.get("RANK", "?"))
    if placed:
        log.info(placed)
    import faulthandler

    faulthandler.enable()  # a fatal signal (a segfault in native code) leaves every thread's stack in the log
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the launcher asks a hung rank for its stack
    stop = {"requested": False}
    for sig in (signal.SIGUSR2, signal.SIGTERM):  # SLURM: time limit (USR2), preemption (TERM first)
        signal.signal(sig, lambda *_: stop.update(requested=True))
    from orchestrator.train import world

    try:
        history = train(Path(sys.argv[1]), should_stop=lambda: stop["requested"])
    except RankExit as e:
        if e.status == EXIT_LEFT:  # dismissed by the coordinator: its last beat is no hang
            world.forget_beat()
        if e.message:
            log.error(e.message)
        sys.exit(e.status)
    except Exception as e:  # the error's own line first (the traceback follows), then the beat that says so
        import traceback

        print(traceback.format_exception_only(e)[-1].strip(), file=sys.stderr, flush=True)
        world.crashed_beat(e, Path(os.environ.get(rundir.ENV_RUN_DIR, sys.argv[1])))  # as the trainer's run_dir
        raise
    world.forget_beat()
    sys.exit(EXIT_STOPPED if history.get("stopped") else EXIT_OK)


def run() -> None:
    """The entry point: main(), and out with the status it decided (finished, stopped, dismissed, or a
    RankExit's) through rundir.exit_now, skipping the interpreter's teardown that can abort a rank
    that finished its work. A rank that crashed (main re-raises its error) dies as Python ends it:
    traceback, teardown, status 1, after its crashed beat, which the SLURM supervisor reads while
    the step still runs (its step stopped at once)."""
    try:
        main()
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            rundir.exit_now(e.code or 0)
        raise


if __name__ == "__main__":
    run()
