"""What every torchtitan release line renders alike (its release modules import this, never the
package's __init__, which imports them)."""
from __future__ import annotations


def checkpoint_words(ck: dict, run_dir) -> list[str]:
    """--checkpoint.* from the plan's training.checkpoint (none when it never saves): a path,
    since torchtitan saves to a file system."""
    if ck["every"] <= 0:
        return []
    folder = (ck["dir"] or f"{run_dir}/checkpoints").removeprefix("file://")
    return ["--checkpoint.enable", f"--checkpoint.folder={folder}", f"--checkpoint.interval={ck['every']}",
            f"--checkpoint.keep_latest_k={ck['keep']}"]
