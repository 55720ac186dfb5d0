"""What a plan leaves in its run directory: plan.json, plan.md and the pictures."""
from __future__ import annotations

import json
from pathlib import Path


def json_default(x):
    if hasattr(x, "item"):  # numpy scalars
        return x.item()
    raise TypeError(f"not JSON serialisable: {type(x)}")


def write_plan(plan, out_dir: Path, figures: bool = True) -> dict[str, Path]:
    """plan.json, plan.md and (optionally) the figures, next to each other."""
    from orchestrator.plan.report import render_markdown

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "plan.json", "md": out_dir / "plan.md"}
    paths["json"].write_text(json.dumps(plan.to_json(), indent=2, default=json_default) + "\n")
    paths["md"].write_text(render_markdown(plan))
    if figures and plan.layout is not None:
        from orchestrator.plan.figures import write_figures

        paths.update(write_figures(plan, out_dir))
    return paths
