"""The frameworks' own code for the tests: each release in a folder of its own under
`.frameworks/`, installed without its dependencies (their requirements pull a multi-GB CUDA
torch) plus the few light packages its code imports, and run beside the project's torch in a
subprocess whose PYTHONPATH puts that folder first. `make test` installs them
(`python tests/frameworks.py`); nothing is imported into the test process itself.

    python tests/frameworks.py            # install every release below that is missing
    python tests/frameworks.py --list     # what is installed where
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOME = ROOT / ".frameworks"
STUBS = Path(__file__).resolve().parent / "framework_stubs"  # stand-ins for modules a CPU can't import (triton)

# folder name -> (the release itself, installed --no-deps; the light packages its code imports)
RELEASES: dict[str, tuple[list[str], list[str]]] = {
    # Megatron-Core's parallel_state (initialize_model_parallel, RankGenerator): tests/megatron_core.py
    "megatron-core-0.16.1": (["megatron-core==0.16.1"], ["einops==0.8.1"]),
    # torchtitan: its config parser (tyro), ParallelDims and pipeline split. 0.3 selects a model's
    # config from a registry whose modules import its data loaders (datasets), checkpointing and
    # float8 (torchao), so those come too; torchdata, spmd_types and torchao ask for torch: no deps.
    "torchtitan-0.2.0": (["torchtitan==0.2.0", "torchdata==0.11.0"], ["tyro", "tokenizers", "datasets"]),
    "torchtitan-0.3.0": (["torchtitan==0.3.0", "torchdata==0.11.0", "spmd_types==0.3.1", "torchao==0.18.0"],
                         ["tyro", "tokenizers", "safetensors", "einops", "datasets"]),
}


def folder(name: str) -> Path:
    return HOME / name


def installed(name: str) -> bool:
    return (folder(name) / ".installed").exists()


def env(name: str) -> dict[str, str]:
    """The environment of a subprocess that imports release `name` (beside the project's torch)."""
    paths = [str(folder(name))] + ([str(STUBS)] if STUBS.exists() else []) + [str(ROOT)]
    old = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths + ([old] if old else []))}


def run(name: str, code: str, timeout: float = 300, stdin: str | None = None) -> subprocess.CompletedProcess:
    """`python -c code` with release `name` importable (`stdin`: its standard input)."""
    return subprocess.run([sys.executable, "-c", code], env=env(name), cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, input=stdin)


def install(name: str) -> None:
    release, light = RELEASES[name]
    target = folder(name)
    pip = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-warn-conflicts", "--target", str(target)]
    subprocess.run(pip + ["--no-deps", *release], check=True)
    if light:
        # the light packages with their own dependencies, but never torch: it is the project's
        subprocess.run(pip + [*light], check=True)
        for p in [*target.glob("torch"), *target.glob("torch-*.dist-info"), *target.glob("nvidia*")]:
            raise SystemExit(f"{name}: {p.name} was pulled into {target}; pin the package that asked for it")
    (target / ".installed").write_text(" ".join(release + light) + "\n")


def main(argv: list[str]) -> int:
    if "--list" in argv:
        for name in RELEASES:
            print(f"{name:28} {'installed' if installed(name) else 'missing':10} {folder(name)}")
        return 0
    for name in RELEASES:
        if not installed(name):
            print(f"== installing {name} into {folder(name)} (no dependencies; beside the project's torch)")
            install(name)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
