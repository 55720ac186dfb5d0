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


def compiled(stack: dict, tp: int) -> tuple[list[str], bool]:
    """What torch.compile must cover for the run to be the one planned: the model where the plan
    prices fused elementwise kernels (stack.fused_elementwise: Inductor fuses the blocks' norms,
    SwiGLU and rotary), the loss where it prices the compiled cross-entropy (stack.cross_entropy=
    inductor); and async TP (stack.tp_overlap > 0 with TP), which torchtitan runs only on a compiled
    model. (components, async TP)."""
    parts = (["model"] if stack["fused_elementwise"] else []) + (["loss"] if stack["cross_entropy"] == "inductor" else [])
    return parts, tp > 1 and stack["tp_overlap"] > 0
