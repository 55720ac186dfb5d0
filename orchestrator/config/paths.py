"""Where the config tree lives: `conf/` and `recipes/` at the top of a checkout; a wheel
carries them inside the package (`orchestrator/conf`, `orchestrator/recipes`), so an
installed orchestrator composes from any directory."""
from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]


def _data_dir(name: str) -> Path:
    packaged = PACKAGE_DIR / name  # inside an installed wheel
    return packaged if packaged.is_dir() else PACKAGE_DIR.parent / name


CONF_DIR = _data_dir("conf")
RECIPES_DIR = _data_dir("recipes")
