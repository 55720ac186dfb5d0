"""`orchestrate`: parse the command line and dispatch. Nothing else lives here.

    orchestrate [key=value ...]        compose, plan, write the plan, hand it to the launcher
    orchestrate -m [key=a,b ...]       a sweep: every point planned before anything runs
    orchestrate --cfg [key=value ...]  print the composed config and stop
    orchestrate --help                 the config groups and their options

Exit status: 0 success, 1 the launched job failed, 2 the configuration was rejected
(every problem printed, nothing launched or submitted), 130 interrupted (Ctrl-C),
141 the output pipe was closed.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from orchestrator.config.errors import EXIT_REJECTED, ConfigError, Problem, print_rejection

EXIT_INTERRUPTED, EXIT_PIPE = 130, 141
GROUPS = ("hardware", "model", "layout", "schedule", "launcher", "recipe")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        code = dispatch(argv)
    except KeyboardInterrupt:
        print("\ninterrupted: every rank this command started was stopped.", file=sys.stderr)
        code = EXIT_INTERRUPTED
    except BrokenPipeError:  # `orchestrate ... | head`: stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = EXIT_PIPE
    except Exception as e:  # a bug, not a bad configuration: say so, keep the traceback in a file
        code = _internal_error(e)
    sys.exit(code)


def _internal_error(e: Exception) -> int:
    import tempfile
    import traceback

    with tempfile.NamedTemporaryFile("w", prefix="orchestrate-error-", suffix=".log", delete=False) as f:
        traceback.print_exc(file=f)
    print(f"\ninternal error: {type(e).__name__}: {e} -- a bug in orchestrator, not in your configuration; "
          f"the traceback is in {f.name} (please report it).", file=sys.stderr)
    return 1


def dispatch(argv: list[str]) -> int:
    if {"-h", "--help"} & set(argv):
        print(usage())
        return 0
    plugin = [a for a in argv if a.startswith(("hydra/launcher=", "hydra/sweeper="))]
    if plugin:
        return print_rejection([Problem(plugin[0].split("=")[0], f"{plugin[0]!r}: Hydra's launcher plugins would "
                                        "submit every sweep point unplanned and size each job from their own keys.",
                                        "use launcher=slurm with -m: every point is planned first, invalid points "
                                        "are never submitted, and each job is sized from its plan.")])
    if "-m" in argv or "--multirun" in argv:
        from orchestrator.launch.sweep import run_sweep

        return run_sweep([a for a in argv if a not in ("-m", "--multirun")])
    if "--cfg" in argv:
        return show_config([a for a in argv if a != "--cfg"])
    return run([a for a in argv if not a.startswith("-")], argv)


def compose_or_reject(overrides: list[str]):
    """The composed config, or (None, exit status) once every problem was printed: the
    refused overrides, and what the planner and the launcher say about the rest."""
    from orchestrator.config.compose import compose

    try:
        return compose(overrides, hydra=True), None
    except ConfigError as e:
        problems = list(e.problems)
        if e.partial is not None:
            problems += _plan_problems(e.partial)
        return None, print_rejection(problems)


def _plan_problems(cfg) -> list[Problem]:
    from orchestrator.launch.base import launcher_for
    from orchestrator.plan import make_plan

    plan = make_plan(cfg)
    if not plan.valid:
        return plan.errors
    return launcher_for(plan, Path(cfg.hydra.run.dir)).preflight()


def show_config(overrides: list[str]) -> int:
    from omegaconf import OmegaConf, open_dict

    cfg, code = compose_or_reject(overrides)
    if cfg is None:
        return code
    with open_dict(cfg):
        cfg.pop("hydra")
    print(OmegaConf.to_yaml(cfg))
    return 0


def run(overrides: list[str], argv: list[str]) -> int:
    """Plan one configuration, write the plan into the run directory, hand it to the launcher."""
    from orchestrator.launch.base import launcher_for
    from orchestrator.launch.manifest import write_config
    from orchestrator.plan import make_plan
    from orchestrator.plan.artifacts import write_plan
    from orchestrator.plan.report import render_table

    cfg, code = compose_or_reject(overrides)
    if cfg is None:
        return code
    run_dir = Path(cfg.hydra.run.dir)
    plan = make_plan(cfg)
    print(render_table(plan))
    if plan.spec is None:  # the values did not make a typed config (make_plan named them): nothing to write
        return print_rejection(plan.errors)
    if plan.valid:  # values that reach a shell, a batch script or a path: before anything is written
        launcher = launcher_for(plan, run_dir, argv)
        problems = launcher.preflight()
        if problems:
            return print_rejection(problems, "submitted" if plan.spec.launcher.name.value == "slurm" else "launched")
    from orchestrator.launch import privacy  # owner-only by default; another user's run refused

    lc = plan.spec.launcher
    refused = privacy.other_owner(run_dir, plan.spec.training.checkpoint.dir, lc.allow_other_owner)
    if refused:
        return print_rejection(refused)
    privacy.owner_only(run_dir, lc.group_readable)
    paths = write_plan(plan, run_dir, figures=plan.spec.figures and plan.valid, command=argv, overrides=overrides)
    write_config(run_dir, cfg, overrides, argv)
    print(f"\nplan written to {paths['json']}" + (" (pictures beside it)" if "cluster" in paths else ""))
    if not plan.valid:
        return print_rejection(plan.errors)
    return launcher.submit()


def usage() -> str:
    from orchestrator.config.compose import register
    from orchestrator.config.paths import CONF_DIR
    from hydra.core.config_store import ConfigStore

    register()
    repo = ConfigStore.instance().repo
    lines = [__doc__.strip(), "", "Config groups (select with group=option; every key is a one-line override):"]
    for group in GROUPS:
        names = {p.stem for p in (CONF_DIR / group).glob("*.yaml")}
        names |= {k.removesuffix(".yaml") for k in repo.get(group, {})}
        lines.append(f"  {group:<9} {', '.join(sorted(names))}")
    lines += ["", "Keys and defaults: orchestrator/config/schema.py. Examples:",
              "  orchestrate recipe=llama3_405b                      # a published run, predicted vs published",
              "  orchestrate recipe=llama3_405b layout=auto          # search the layout",
              "  orchestrate hardware=cpu model=tiny cluster.nodes=2 hardware.gpus_per_node=4 launcher=local"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()


def runs_main(argv: list[str] | None = None) -> None:
    """`orchestrate-runs`: list, inspect, follow, cancel and resume runs (local and SLURM)."""
    import argparse

    ap = argparse.ArgumentParser(prog="orchestrate-runs", description=runs_main.__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("list", help="every run under a folder, newest first")
    ls.add_argument("--root", default="outputs", type=Path)
    for name, text in (("status", "where one run stands, its events and how to continue it"),
                       ("logs", "the supervisor's and rank 0's output"), ("cancel", "stop a run (its job, its ranks)"),
                       ("resume", "continue a run from its last complete checkpoint with its own config")):
        p = sub.add_parser(name, help=text)
        p.add_argument("run", type=Path, help="a run directory (outputs/...)")
        if name == "logs":
            p.add_argument("-f", "--follow", action="store_true", help="keep printing until the run ends")
        if name == "resume":
            p.add_argument("overrides", nargs="*", help="key=value changes (today's resume rules apply)")
    args = ap.parse_args(argv)
    try:
        code = _runs(args)
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = EXIT_PIPE
    sys.exit(code)


def _runs(args) -> int:
    from orchestrator.launch import runs

    if args.command == "list":
        rows = [runs.summary(r) for r in runs.find_runs(args.root)]
        print(f"{'state':<11} {'launcher':<8} {'layout':<22} {'steps':>9} {'loss':>8} {'pred s':>8} {'meas s':>8}  run")
        for r in rows:
            fmt = lambda x, f: format(x, f) if x is not None else "-"  # noqa: E731
            print(f"{r['state']:<11} {r['launcher']:<8} {r['layout']:<22} {r['steps']:>9} {fmt(r['loss'], '8.4f'):>8} "
                  f"{fmt(r['predicted_step_s'], '8.3f'):>8} {fmt(r['measured_step_s'], '8.3f'):>8}  {r['run']}")
        return 0
    if not (args.run / "plan.json").exists():
        return print_rejection([Problem("run", f"{args.run} is not a run directory (no plan.json).",
                                        "orchestrate-runs list shows the runs.")], "done")
    if args.command == "status":
        return runs.show_status(args.run)
    if args.command == "logs":
        return runs.show_logs(args.run, args.follow)
    if args.command == "cancel":
        return runs.cancel(args.run)
    for line in runs.code_drift(args.run):
        print(f"warning: {line}", file=sys.stderr)
    overrides = runs.resume_overrides(args.run, args.overrides)
    return run(overrides, ["orchestrate-runs", "resume", str(args.run), *args.overrides])
