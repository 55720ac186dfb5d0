"""Run inside a torchtitan release's subprocess (tests/frameworks.run): what that release's own
selective activation checkpointing (op level, what training.recompute=selective renders) runs again.

Builds a small Llama 3 with the release's own model code, counts the matmul FLOPs of one forward and
backward with torch's FlopCounterMode, then wraps every block with the release's own selective op AC
(0.2: apply_ac with the model's save list; 0.3: SelectiveAC) and counts again: the difference is the
forward matmul work the policy runs again in backward. Prints one JSON object: the model's shape,
the tokens and both counts. CPU only; the attention runs through SDPA's CPU kernel."""
import json
from importlib.metadata import version

import torch
from torch.utils.flop_counter import FlopCounterMode

from torch.utils._triton import has_triton_package  # noqa: E402

has_triton_package()  # cached False before torchtitan imports the triton stand-in

RELEASE = version("torchtitan")
LINE = ".".join(RELEASE.split(".")[:2])
BATCH, SEQ = 2, 32


class CausalSDPA(torch.nn.Module):
    """0.3's inner attention as a CPU runs it: (batch, sequence, heads, head dim) in and out. Not a
    matmul, so the counts below are the same whichever attention kernel the blocks call."""

    def forward(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False, **_):
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                               is_causal=True, scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)


def build():
    if LINE == "0.2":
        from torchtitan.models.llama3.model.args import TransformerModelArgs
        from torchtitan.models.llama3.model.model import Transformer

        args = TransformerModelArgs(dim=128, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=256, multiple_of=64,
                                    max_seq_len=SEQ)
        model = Transformer(args)
        return model, dict(hidden=args.dim, layers=args.n_layers, heads=args.n_heads, kv_heads=args.n_kv_heads,
                           vocab=args.vocab_size)
    from torchtitan.models.llama3 import model_registry

    config = model_registry("debugmodel").model
    model = config.build()
    for block in model.layers.values():  # flex attention has no backward on a CPU: torch's causal SDPA instead
        block.attention.inner_attention = CausalSDPA()
    blk = next(iter(model.layers.values())) if hasattr(model.layers, "values") else model.layers[0]
    attn = blk.attention
    kv = getattr(attn, "n_kv_heads", None) or getattr(attn, "num_kv_heads", None) or config.layers[0].attention.n_kv_heads
    heads = getattr(attn, "n_heads", None) or getattr(attn, "num_heads", None) or config.layers[0].attention.n_heads
    return model, dict(hidden=config.dim, layers=len(config.layers), heads=heads, kv_heads=kv, vocab=config.vocab_size)


def matmul_flops(model, tokens) -> int:
    with FlopCounterMode(display=False) as fc:
        out = model(tokens)
        out.float().sum().backward()
    counts = fc.get_flop_counts().get("Global", {})
    return int(sum(v for op, v in counts.items() if str(op).split(".")[-1] in ("mm", "addmm", "linear")))


def apply_selective(model) -> None:
    if LINE == "0.2":
        from torchtitan.config.job_config import ActivationCheckpoint
        from torchtitan.distributed.activation_checkpoint import apply_ac
        from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list

        apply_ac(model, ActivationCheckpoint(mode="selective", selective_ac_option="op"),
                 op_sac_save_list=_op_sac_save_list)
    else:
        from torchtitan.distributed.activation_checkpoint import SelectiveAC

        SelectiveAC.Config().build().apply(model)


def main() -> None:
    torch.manual_seed(0)
    model, shape = build()
    w1 = next(m for n, m in model.named_modules() if n.endswith("feed_forward.w1"))
    shape["ffn_hidden"] = w1.weight.shape[0]
    tokens = torch.randint(0, shape["vocab"], (BATCH, SEQ))
    plain = matmul_flops(model, tokens)
    apply_selective(model)
    sac = matmul_flops(model, tokens)
    print(json.dumps(dict(release=RELEASE, tokens=BATCH * SEQ, mm_plain=plain, mm_selective=sac, **shape)))


if __name__ == "__main__":
    main()
