"""Every value that reaches an sbatch script, an srun line or a shell, validated whole
before anything is written or submitted (`problems`), and the srun line itself.

Values are matched from start to end (`fullmatch`, so a trailing newline fails), have a
length limit, and numbers must be in range. Set-up lines must split as shell words with
balanced quotes and contain no operators, substitutions or redirections.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

from orchestrator.config.errors import Problem

NAME = re.compile(r"[A-Za-z0-9_.,:@%+=/\-\[\]]{1,256}")
PATH = re.compile(r"[A-Za-z0-9_.,:@%+=/\-]{1,1024}")
OPTION = re.compile(r"[a-z][a-z0-9_\-]{0,63}")
WORD = re.compile(r"[A-Za-z0-9_.,:@%+=/\-'\" ]{1,1024}")
FIELDS = ("job_name", "partition", "account", "qos", "constraint", "exclude", "container_image", "container_python",
          "container_workdir")
SWITCHES = re.compile(r"([1-9][0-9]{0,5})(@(\d{1,4}-)?\d{1,6}(:\d{1,2}){0,2})?")
NUMBERS = {"time_min": (1, 525600), "cpus_per_task": (1, 4096), "signal_delay_s": (0, 86400),
           "max_requeues": (0, 1000)}


def problems(lc, run_dir: Path) -> list[Problem]:
    """Problems with `launcher.*` (a SlurmLauncherConfig) and the run directory, all at once."""
    out = []
    for f in FIELDS:
        v = getattr(lc, f, None)
        if v is not None and not NAME.fullmatch(str(v)):
            out.append(Problem(f"launcher.{f}", f"{str(v)[:80]!r} is not a plain value (allowed: letters, digits "
                               f"and _ . , : @ % + = / - [ ], at most 256 characters, no spaces or newlines).",
                               "use a plain name."))
    for f, (lo, hi) in NUMBERS.items():
        v = getattr(lc, f)
        if not lo <= v <= hi:
            out.append(Problem(f"launcher.{f}", f"must be between {lo} and {hi}, got {v}.", f"set launcher.{f} "
                               f"in that range."))
    if not out and lc.signal_delay_s >= lc.time_min * 60:
        out.append(Problem("launcher.signal_delay_s, launcher.time_min", f"the save-and-requeue signal "
                           f"{lc.signal_delay_s} s before the end of a {lc.time_min}-minute job comes before it starts.",
                           "use a signal_delay_s shorter than the time limit."))
    if lc.switches is not None and not SWITCHES.fullmatch(str(lc.switches)):
        out.append(Problem("launcher.switches", f"{str(lc.switches)[:80]!r} is not N[@max-wait] (sbatch --switches).",
                           "e.g. launcher.switches=4 (at most 4 leaf switches) or launcher.switches=4@30 (wait up "
                           "to 30 minutes for them)."))
    if lc.segment is not None and not 1 <= lc.segment <= 65536:
        out.append(Problem("launcher.segment", f"must be between 1 and 65536 nodes, got {lc.segment}.",
                           "set launcher.segment to the nodes that must share one block (topology/block)."))
    for i, line in enumerate(lc.setup or []):
        why = _setup_problem(str(line))
        if why:
            out.append(Problem(f"launcher.setup[{i}]", f"{str(line)[:80]!r} {why}",
                               "put complex set-up in a script on the cluster and call it by name."))
    for k, v in (lc.additional_parameters or {}).items():
        if not OPTION.fullmatch(str(k)) or not (v is True or NAME.fullmatch(str(v))):
            out.append(Problem(f"launcher.additional_parameters.{k}", f"{k}={str(v)[:80]!r} is not a plain sbatch "
                               f"option.", "use a plain option name and value."))
    for i, m in enumerate(lc.container_mounts or []):
        if not PATH.fullmatch(str(m)) or str(m).count(":") > 2:
            out.append(Problem(f"launcher.container_mounts[{i}]", f"{str(m)[:80]!r} is not SRC:DST[:FLAGS] of plain "
                               f"paths.", "e.g. launcher.container_mounts=[/data:/data:ro]."))
    if not PATH.fullmatch(str(run_dir)):
        out.append(Problem("hydra.run.dir", f"{str(run_dir)[:80]!r} would be written into #SBATCH lines, and holds "
                           f"a space, a newline or a shell character.",
                           "use a run directory of letters, digits and _ . , : @ % + = / -."))
    return out


def _setup_problem(line: str) -> str | None:
    if not WORD.fullmatch(line):
        return ("is not a plain command: ';', '&', '|', '$', backquotes, redirections, brackets and newlines are "
                "refused.")
    try:
        shlex.split(line)
    except ValueError as e:  # an unbalanced quote would swallow the lines after it
        return f"does not split into shell words ({e})."
    return None


def container_args(lc, run_dir: Path) -> list[str]:
    """pyxis/enroot options for the training step (empty without a container image). The run
    directory is mounted at its own path: the ranks read the plan and the code snapshot there
    and write logs, metrics and (by default) checkpoints."""
    if not lc.container_image:
        return []
    out = [f"--container-image={lc.container_image}",
           "--container-mounts=" + ",".join([f"{run_dir}:{run_dir}", *lc.container_mounts])]
    if lc.container_workdir:
        out.append(f"--container-workdir={lc.container_workdir}")
    return out


def srun_command(lc, plan_dir: Path, nodes: list[str], tasks_per_node: int, python: str,
                 run_dir: Path | None = None) -> list[str]:
    """The srun line of one training attempt on `nodes` (one task per GPU). `--no-kill`
    keeps the step alive when one of its nodes dies, so the supervisor decides. In a
    container the image's interpreter runs the worker."""
    from orchestrator.launch.trainers import program
    from orchestrator.plan.hostlist import compress

    if lc.container_image:
        python = lc.container_python
    return ["srun", "--unbuffered", "--no-kill", "--kill-on-bad-exit=0", "--overlap", f"--nodes={len(nodes)}",
            f"--ntasks-per-node={tasks_per_node}", f"--ntasks={len(nodes) * tasks_per_node}",
            f"--nodelist={compress(nodes)}", f"--cpus-per-task={lc.cpus_per_task}",
            *container_args(lc, run_dir or plan_dir),
            *program(plan_dir, python)]  # the built-in worker, or the trainer (launch/trainers.py)


KEEPER_STEP = "keepers"  # the snapshot keepers' step name: a standby's takeover keeps it (launch/batch.cancel_steps)


def keeper_command(lc, run_dir: Path, nodes: list[str], python: str, key_file: Path, token: str) -> list[str]:
    """The srun step of the snapshot keepers (train/keeper.py, launch/keepers.SrunKeepers): a task on
    each of `nodes`, sharing the allocation with the training steps (--overlap) and kept when a node
    dies (--no-kill). Each writes where it listens into RUN_DIR/keepers/<node>.json and its log into
    logs/keeper<task>.log (by its node's slurmstepd, not through this srun)."""
    from orchestrator import rundir
    from orchestrator.plan.hostlist import compress

    if lc.container_image:
        python = lc.container_python
    return ["srun", "--overlap", "--no-kill", "--kill-on-bad-exit=0", f"--job-name={KEEPER_STEP}",
            f"--nodes={len(nodes)}", "--ntasks-per-node=1", f"--ntasks={len(nodes)}", f"--nodelist={compress(nodes)}",
            "--cpus-per-task=1", f"--output={Path(run_dir) / rundir.LOGS / 'keeper%t.log'}",
            *container_args(lc, run_dir), python, "-m", "orchestrator.train.keeper", str(key_file), "--host=hostname",
            f"--announce={Path(run_dir) / rundir.KEEPERS}", f"--token={token}"]
