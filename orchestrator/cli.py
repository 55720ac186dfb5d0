"""`orchestrate`: parse the command line and dispatch. Nothing else lives here.

    orchestrate [key=value ...]          compose, plan, write the plan, hand it to the launcher
    orchestrate -m [key=a,b ...]         a sweep: every point planned before anything runs
    orchestrate --cfg job|hydra|all ...  print the composed config and stop (--resolve, --package/-p)
    orchestrate -cd DIR hardware=NAME    a site's own presets in DIR/<group>/*.yaml, beside the packaged ones
    orchestrate --info [WHAT]            Hydra's view: all, config, defaults, defaults-tree, plugins, searchpath
    orchestrate --help | --hydra-help    the config groups and their options | Hydra's flags

Hydra's flags mean what they mean for any @hydra.main app (--config-dir/-cd, --config-name/-cn,
--shell-completion/-sc install=bash, ...); an unknown flag is refused, listing the accepted ones.

Exit status: 0 success, 1 the launched job failed, 2 the configuration was rejected
(every problem printed, nothing launched or submitted), 130 interrupted (Ctrl-C),
141 the output pipe was closed.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from orchestrator.config.errors import ConfigError, Problem, print_rejection
from orchestrator.rundir import EXIT_INTERRUPTED, EXIT_PIPE

GROUPS = ("hardware", "model", "layout", "schedule", "fabric", "stack", "launcher", "recipe")
INFO = ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")
CFG = ("job", "hydra", "all")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Ctrl-C (SIGINT) stops the run and every rank, exit 130, even when this process inherited
    # SIGINT ignored (a background job of a non-interactive shell, a test runner's worker):
    # Python keeps an inherited SIG_IGN, and the launcher would then supervise on regardless.
    signal.signal(signal.SIGINT, signal.default_int_handler)
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


class _Refused(Exception):
    """argparse's complaint, turned into a rejection (exit 2, the accepted flags listed)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise _Refused(message)


def flag_parser() -> argparse.ArgumentParser:
    """Hydra's command-line flags (hydra/_internal/utils.py:get_args_parser, Hydra 1.3), for this app."""
    ap = _Parser(prog="orchestrate", add_help=False, allow_abbrev=False,
                 description="orchestrate: plan, place, launch and survive large-model training.")
    ap.add_argument("overrides", nargs="*", help="key=value overrides and group=option choices")
    ap.add_argument("--help", "-h", action="store_true", help="this application's help: groups and options")
    ap.add_argument("--hydra-help", action="store_true", help="Hydra's help: its flags and groups")
    ap.add_argument("--version", action="store_true", help="the versions of orchestrator and Hydra")
    ap.add_argument("--cfg", "-c", choices=CFG, help="show the config instead of running [job|hydra|all]")
    ap.add_argument("--resolve", action="store_true", help="with --cfg: resolve interpolations before printing")
    ap.add_argument("--package", "-p", help="with --cfg: the config package to show (e.g. layout)")
    ap.add_argument("--run", "-r", action="store_true", help="plan one configuration and launch it (the default)")
    ap.add_argument("--multirun", "-m", action="store_true", help="a sweep: plan every point, launch the valid")
    ap.add_argument("--shell-completion", "-sc", action="store_true",
                    help="shell completion: -sc install=bash (zsh, fish), -sc uninstall=bash")
    ap.add_argument("--config-name", "-cn", default="config", help="the primary config (default: config)")
    ap.add_argument("--config-dir", "-cd", help="a folder of more presets (DIR/hardware/*.yaml, ...), "
                    "searched after the packaged tree")
    ap.add_argument("--info", "-i", choices=INFO, help="information about the app and Hydra [%s]" % "|".join(INFO))
    return ap


def accepted_flags() -> list[str]:
    return [", ".join(a.option_strings) for a in flag_parser()._actions if a.option_strings]


def parse(argv: list[str]) -> argparse.Namespace:
    """The flags and the overrides, in any order; `--cfg`/`--info` alone mean `job`/`all`
    (an older spelling of this CLI; Hydra's `--info` does the same). Raises _Refused."""
    argv, implied = list(argv), {"--cfg": "job", "-c": "job", "--info": "all", "-i": "all"}
    hydra_only = [a for a in argv if a in ("-cp", "--config-path", "--experimental-rerun")
                  or a.startswith(("--config-path=", "--experimental-rerun="))]
    if hydra_only:  # before argparse reads -cp as -c p
        raise _Refused(f"{hydra_only[0].split('=')[0]} is a flag of Hydra this app does not take")
    for i in range(len(argv) - 1, -1, -1):
        if argv[i] in implied and (i + 1 == len(argv) or argv[i + 1] not in CFG + INFO):
            argv.insert(i + 1, implied[argv[i]])
    args, extra = flag_parser().parse_known_intermixed_args(argv)
    unknown = [a for a in extra if a.startswith("-")]
    if unknown or extra:
        raise _Refused(f"unrecognized arguments: {' '.join(unknown or extra)}")
    return args


def _refuse_flags(message: str) -> int:
    hint = (" (--config-path replaces a @hydra.main app's own folder; here --config-dir/-cd adds a site's "
            "presets to the packaged tree)" if "--config-path" in message or "-cp" in message else "")
    return print_rejection([Problem("command line", f"{message}{hint}.",
                                    "use key=value overrides and these flags: " + "; ".join(accepted_flags()))],
                           "run")


def dispatch(argv: list[str]) -> int:
    try:
        args = parse(argv)
    except _Refused as e:
        return _refuse_flags(str(e))
    overrides, where = args.overrides, dict(config_dir=args.config_dir, config_name=args.config_name)
    modes = [m for m, on in (("--run", args.run), ("--multirun", args.multirun), ("--cfg", args.cfg),
                             ("--info", args.info), ("--shell-completion", args.shell_completion)) if on]
    if len(modes) > 1:
        return _refuse_flags(f"{' and '.join(modes)} cannot be combined: give one of them")
    if (args.resolve or args.package) and not (args.cfg or args.help):
        return _refuse_flags("--resolve and --package go with --cfg")
    if args.help:
        print(usage(args.config_dir))
        return 0
    if args.version:
        return _version()
    if args.hydra_help:
        return _hydra_call(lambda app: app.hydra_help(args.config_name, flag_parser(), args), args)
    plugin = [a for a in overrides if a.startswith(("hydra/launcher=", "hydra/sweeper="))]
    if plugin:
        return print_rejection([Problem(plugin[0].split("=")[0], f"{plugin[0]!r}: Hydra's launcher plugins would "
                                        "submit every sweep point unplanned and size each job from their own keys.",
                                        "use launcher=slurm with -m: every point is planned first, invalid points "
                                        "are never submitted, and each job is sized from its plan.")])
    if args.shell_completion:
        return _hydra_call(lambda app: app.shell_completion(args.config_name, overrides), args,
                           "use -sc install=bash (or zsh, fish), -sc uninstall=bash or -sc query=bash.")
    if args.multirun:
        from orchestrator.launch.sweep import run_sweep

        return run_sweep(overrides, **where)
    if args.cfg:
        return show_config(overrides, args)
    if args.info:
        cfg, code = compose_or_reject(overrides, **where)
        if cfg is None:
            return code
        return _hydra_call(lambda app: app.show_info(args.info, args.config_name, overrides), args)
    return run(overrides, argv, **where)


def _hydra_call(call, args, fix: str = "check the overrides (orchestrate --help).") -> int:
    """One of Hydra's own commands on this app's Hydra; its refusals become rejections."""
    from orchestrator.config.compose import hydra_app

    try:
        call(hydra_app(args.config_dir))
    except ConfigError as e:
        return print_rejection(e.problems, "run")
    except ValueError as e:
        return print_rejection([Problem("command line", str(e).strip().splitlines()[0].rstrip(".") + ".", fix)], "run")
    return 0


def _version() -> int:
    from importlib import metadata

    import hydra

    try:
        own = metadata.version("orchestrator")
    except metadata.PackageNotFoundError:
        own = "(not installed: a checkout)"
    print(f"orchestrator {own}\nHydra {hydra.__version__}")
    return 0


def compose_or_reject(overrides: list[str], config_dir: str | None = None, config_name: str = "config"):
    """The composed config, or (None, exit status) once every problem was printed: the
    refused overrides, and what the planner and the launcher say about the rest."""
    from orchestrator.config.compose import compose

    try:
        return compose(overrides, hydra=True, config_dir=config_dir, config_name=config_name), None
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


def show_config(overrides: list[str], args: argparse.Namespace) -> int:
    """`--cfg job|hydra|all [--package P] [--resolve]`, printed as Hydra prints it, once the
    overrides composed (a bad one is a rejection, as for a run)."""
    from omegaconf import Container, OmegaConf

    from orchestrator.config.compose import hydra_app

    cfg, code = compose_or_reject(overrides, args.config_dir, args.config_name)
    if cfg is None:
        return code
    from hydra.core.hydra_config import HydraConfig

    HydraConfig.instance().set_config(cfg)  # ${hydra:...} and ${now:...} resolve as in a run
    OmegaConf.set_readonly(cfg.hydra, None)
    cfg = hydra_app(args.config_dir).get_sanitized_cfg(cfg, args.cfg)
    package = None if args.package in (None, "_global_") else args.package
    node = cfg if package is None else OmegaConf.select(cfg, package, default=None)
    if node is None:
        return print_rejection([Problem("--package", f"{package!r} is not in the {args.cfg} config.",
                                        f"use one of {sorted(str(k) for k in cfg.keys())} (or a dotted key).")], "run")
    if not isinstance(node, Container):
        print(node)
        return 0
    if package is not None:
        print(f"# @package {package}")
    if args.resolve:
        OmegaConf.resolve(node)
    sys.stdout.write(OmegaConf.to_yaml(node))
    return 0


def run(overrides: list[str], argv: list[str], config_dir: str | None = None, config_name: str = "config") -> int:
    """Plan one configuration, write the plan into the run directory, hand it to the launcher."""
    from orchestrator.launch.base import launcher_for
    from orchestrator.launch.manifest import write_config
    from orchestrator.plan import make_plan
    from orchestrator.report.artifacts import write_plan
    from orchestrator.report.markdown import render_table

    cfg, code = compose_or_reject(overrides, config_dir, config_name)
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

    refused = local_paths(str(cfg.hydra.run.dir), plan.spec.training.checkpoint.dir)
    if refused:
        return print_rejection(refused)
    lc = plan.spec.launcher
    refused = privacy.other_owner(run_dir, plan.spec.training.checkpoint.dir, lc.allow_other_owner)
    if refused:
        return print_rejection(refused)
    try:
        privacy.owner_only(run_dir, lc.group_readable)
    except OSError as e:  # a file where a folder should be, no permission, a read-only file system
        return print_rejection([Problem("hydra.run.dir", f"{str(run_dir)!r} cannot be created: {e.strerror or e}.",
                                        "choose a directory you can write, e.g. hydra.run.dir=outputs/my_run.")])
    paths = write_plan(plan, run_dir, figures=plan.spec.figures and plan.valid, command=argv, overrides=overrides)
    write_config(run_dir, cfg, overrides, argv)
    print(f"\nplan written to {paths['json']}" + (" (pictures beside it)" if "cluster" in paths else ""))
    if not plan.valid:
        return print_rejection(plan.errors)
    return launcher.submit()


def local_paths(run_dir: str, checkpoint_dir: str | None) -> list[Problem]:
    """The run directory (as typed) and a local checkpoint folder: paths the file system can hold."""
    from orchestrator.launch.preflight import folder_problems, path_problems

    out = folder_problems("hydra.run.dir", run_dir)
    local = checkpoint_dir.removeprefix("file://") if checkpoint_dir else None
    if local and "://" not in local:
        out += path_problems("training.checkpoint.dir", local)
    return out


def usage(config_dir: str | None = None) -> str:
    from orchestrator.config.compose import hydra_app

    loader = hydra_app(config_dir).config_loader
    lines = [__doc__.strip(), "", "Config groups (select with group=option; every key is a one-line override):"]
    for group in GROUPS:
        lines.append(f"  {group:<9} {', '.join(sorted(loader.get_group_options(group)))}")
    lines += ["", "Flags:"] + [f"  {a}" for a in accepted_flags()]
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
    except Exception as e:  # a bug: said so, the traceback kept in a file
        code = _internal_error(e)
    sys.exit(code)


def _runs(args) -> int:
    from orchestrator.launch import runs
    from orchestrator.launch.preflight import path_problems

    if args.command == "list":
        refused = path_problems("--root", args.root)
        if refused:
            return print_rejection(refused, "done")
        rows = []
        for r in runs.find_runs(args.root):
            if runs.run_problems(r):  # another program's folder, or a damaged run: listed, not read
                rows.append({"run": str(r), "state": "unreadable", "launcher": "-", "layout": "-", "steps": "-",
                             "loss": None, "predicted_step_s": None, "measured_step_s": None})
            else:
                rows.append(runs.summary(r))
        print(f"{'state':<11} {'launcher':<8} {'layout':<22} {'steps':>9} {'loss':>8} {'pred s':>8} {'meas s':>8}  run")
        for r in rows:
            fmt = lambda x, f: format(x, f) if x is not None else "-"  # noqa: E731
            print(f"{r['state']:<11} {r['launcher']:<8} {r['layout']:<22} {r['steps']:>9} {fmt(r['loss'], '8.4f'):>8} "
                  f"{fmt(r['predicted_step_s'], '8.3f'):>8} {fmt(r['measured_step_s'], '8.3f'):>8}  {r['run']}")
        return 0
    refused = runs.run_problems(args.run, resume=args.command == "resume")
    if refused:
        return print_rejection(refused, "done")
    if args.command == "status":
        return runs.show_status(args.run)
    if args.command == "logs":
        return runs.show_logs(args.run, args.follow)
    if args.command == "cancel":
        return runs.cancel(args.run)
    for line in runs.code_drift(args.run):
        print(f"warning: {line}", file=sys.stderr)
    overrides = runs.resume_overrides(args.run, args.overrides)
    return run(overrides, ["orchestrate-runs", "resume", str(args.run), *args.overrides],
               **runs.resume_sources(args.run))
