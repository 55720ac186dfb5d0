"""Where the data files live: `conf/`, `recipes/` and `published/` at the top of a checkout;
a wheel carries them inside the package (`orchestrator/conf`, `orchestrator/recipes`,
`orchestrator/published`, pyproject.toml's force-include), so an installed orchestrator
composes and runs the published-runs harness from any directory."""
from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]


def _data_dir(name: str, marker: str | None = None) -> Path:
    """`name` inside the package (an installed wheel) when it is there, else beside the package.
    `marker`: a file the folder must hold (orchestrator/published is also a Python package in a
    checkout, without the CSVs)."""
    packaged = PACKAGE_DIR / name
    found = (packaged / marker).is_file() if marker else packaged.is_dir()
    return packaged if found else PACKAGE_DIR.parent / name


CONF_DIR = _data_dir("conf")
RECIPES_DIR = _data_dir("recipes")
PUBLISHED_DIR = _data_dir("published", "runs.csv")  # runs.csv, calibration.csv (orchestrator/published/calibrate.py)
