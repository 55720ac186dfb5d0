"""Recipes: published runs as one Hydra option each (`recipe=NAME`).

Each YAML file in the `recipes/` folder is registered in Hydra's ConfigStore as an
option of the `recipe` group, at the global package, so a recipe can select other
groups (`override /hardware: h100_sxm`) and set any key, and every key stays
overridable on the command line.
"""
from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from orchestrator.config.paths import RECIPES_DIR


def recipe_names() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def register_recipes(cs, recipes_dir: Path) -> None:
    for path in sorted(recipes_dir.glob("*.yaml")):
        node = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        node.setdefault("recipe_name", path.stem)
        cs.store(group="recipe", name=path.stem, node=node, package="_global_")
