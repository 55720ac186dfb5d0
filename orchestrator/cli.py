"""`orchestrate`: compose the config, prove the plan, write it, hand it to a launcher.

Exit codes: 0 success, 2 the configuration was rejected (every problem printed,
nothing submitted), 1 the launched job failed.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from orchestrator.config.recipes import CONF_DIR

EXIT_INVALID = 2


def _register() -> None:
    from orchestrator.config.schema import register

    register()


def compose(overrides: list[str], config_name: str = "config"):
    """Compose the config as the command line would, without a run directory."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    _register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=list(overrides))


def write_plan(plan, out_dir: Path, figures: bool = True) -> dict[str, Path]:
    """plan.json, plan.md and (optionally) the figures, next to each other."""
    from orchestrator.plan.report import render_markdown

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "plan.json", "md": out_dir / "plan.md"}
    paths["json"].write_text(json.dumps(plan.to_json(), indent=2, default=_json_default) + "\n")
    paths["md"].write_text(render_markdown(plan))
    if figures and plan.degrees is not None:
        from orchestrator.plan.figures import write_figures

        paths.update(write_figures(plan, out_dir))
    return paths


def _json_default(x):
    if hasattr(x, "item"):  # numpy scalars
        return x.item()
    raise TypeError(f"not JSON serialisable: {type(x)}")


def run(cfg) -> int:
    """Plan `cfg`, write the plan into the run directory, dispatch to the launcher."""
    from hydra.core.hydra_config import HydraConfig

    from orchestrator.plan import make_plan
    from orchestrator.plan.report import render_table

    out_dir = Path(HydraConfig.get().runtime.output_dir)
    plan = make_plan(cfg)
    print(render_table(plan))
    paths = write_plan(plan, out_dir, figures=bool(cfg.figures) and plan.valid)
    print(f"\nplan written to {paths['json']}")
    if not plan.valid:
        print(f"\nREJECTED: {len(plan.errors)} problem(s); nothing was launched.", file=sys.stderr)
        for p in plan.errors:
            print(f"  - {p}", file=sys.stderr)
        return EXIT_INVALID
    launcher = cfg.launcher.name
    if launcher == "dry":
        return 0
    from orchestrator.launch import launch

    return launch(plan, cfg, out_dir)


def main() -> None:
    import hydra

    _register()
    args = sys.argv[1:]
    plugin = any(a.startswith("hydra/launcher=") for a in args)  # e.g. submitit_slurm: Hydra runs the sweep
    if ("-m" in args or "--multirun" in args) and not plugin:
        # Sweeps are planned point by point before anything runs (launch/sweep.py).
        from orchestrator.launch.sweep import run_sweep

        sys.exit(run_sweep([a for a in args if a not in ("-m", "--multirun")]))

    @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
    def _main(cfg) -> None:
        code = run(cfg)
        if code:
            sys.exit(code)

    _main()


if __name__ == "__main__":
    main()
