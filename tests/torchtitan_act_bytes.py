"""Run inside a torchtitan release's subprocess (tests/frameworks.run): the activation bytes one of that
release's own Llama 3 TransformerBlocks keeps between its forward and its backward, in eager bf16,
under each activation checkpointing torchtitan applies (its own apply_ac: none, op-level selective with
the model's save list, full), and the most it holds at once while its backward runs.

Every storage an op makes is tracked from the op that makes it until it is freed (a TorchDispatchMode
outside the checkpoint's own, StorageWeakRef; views share their base's storage, so nothing is counted
twice). Kept: the storages alive after the forward, less the block's output (the next block's input,
kept there), plus the block's input (the checkpoint holds it). Backward peak: the most alive at once
while the backward runs, less what was alive when it started and the output's gradient (the previous
block's). On a CPU the SDPA call dispatches to _scaled_dot_product_flash_attention_for_cpu, the CPU
kernel of what the save list names for a GPU (_scaled_dot_product_flash_attention): it is saved
alike. Prints one JSON object, bytes per token."""
import json
import os
import sys
from importlib.metadata import version

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from live_bytes import Storages  # noqa: E402

from torch.utils._triton import has_triton_package  # noqa: E402

has_triton_package()  # cached False before torchtitan imports the triton stand-in

RELEASE = version("torchtitan")
BATCH, SEQ = 2, 64
DIM, HEADS, KV_HEADS = 256, 8, 2


class Live(TorchDispatchMode):
    """Storages made by ops (not views of those made `outside`), alive now; the peak since `reset`
    (tests/live_bytes.Storages)."""

    def __init__(self, outside=()):
        super().__init__()
        self.storages = Storages(outside)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.storages.note(out, str(func))
        return out


def build_block():
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import TransformerBlock, precompute_freqs_cis

    args = TransformerModelArgs(dim=DIM, n_layers=1, n_heads=HEADS, n_kv_heads=KV_HEADS, vocab_size=256,
                                multiple_of=256, max_seq_len=SEQ)
    block = TransformerBlock(0, args)
    block.init_weights()
    freqs = precompute_freqs_cis(args.dim // args.n_heads, args.max_seq_len, args.rope_theta)
    return block.to(torch.bfloat16), freqs


def checkpointed(block, mode: str):
    """The block wrapped as the release's apply_ac wraps each of a model's blocks."""
    if mode == "none":
        return block
    from torchtitan.config.job_config import ActivationCheckpoint
    from torchtitan.distributed.activation_checkpoint import apply_ac
    from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list

    holder = torch.nn.Module()
    holder.layers = torch.nn.ModuleDict({"0": block})
    save = set(_op_sac_save_list) | {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}
    apply_ac(holder, ActivationCheckpoint(mode=mode, selective_ac_option="op"), op_sac_save_list=save)
    return holder.layers["0"]


def measure(mode: str) -> dict:
    torch.manual_seed(0)
    block, freqs = build_block()
    block = checkpointed(block, mode)
    x = torch.randn(BATCH, SEQ, DIM, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(BATCH, SEQ, DIM, dtype=torch.bfloat16)
    live = Live([*block.parameters(), freqs, x, grad])
    seen = live.storages
    with live:
        out = block(x, freqs, None)
        kept = seen.alive() - out.untyped_storage().nbytes() + x.untyped_storage().nbytes()
        seen.reset()
        start = seen.peak
        out.backward(grad)
        peak = seen.peak - start
    assert x.grad is not None
    tokens = BATCH * SEQ
    return {"kept": kept / tokens, "backward_peak": peak / tokens}


def main() -> None:
    block, _ = build_block()
    shape = dict(hidden=DIM, heads=HEADS, kv_heads=KV_HEADS, ffn_hidden=block.feed_forward.w1.weight.shape[0],
                 tokens=BATCH * SEQ, seq=SEQ)
    print(json.dumps(dict(release=RELEASE, **shape, **{m: measure(m) for m in ("none", "selective", "full")})))


if __name__ == "__main__":
    main()
