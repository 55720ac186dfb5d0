"""Per pipeline stage: which layers, how many parameters, FLOPs and activation bytes.

Both the byte inventory and the step-time model read these; the first and last
stage also hold the embedding and the output layer, which is why Llama 3 gave
them one layer fewer.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from orchestrator.config.schema import Recompute, Selective
from orchestrator.plan.layout import Layout
from orchestrator.plan.model import ModelMath


@dataclass(frozen=True)
class Stage:
    """One pipeline rank: every layer of every model chunk it runs."""

    index: int
    layers: tuple[int, ...]
    moe_layers: int
    params: float  # on the whole stage (all TP ranks together)
    expert_params: float  # the part expert parallelism shards
    model_flops_tok: float  # per token, forward + backward
    hw_flops_tok: float  # per token, with recomputation
    act_tok: float  # activation bytes per token kept by all its layers
    act_tok_layer_max: float  # the largest single layer's (working set under full recompute)
    embeds: bool
    outputs: bool
    recompute_frac: float = 0.0  # the share of its layers recomputed in full (1 = recompute=full)
    mtp: int = 0  # multi-token prediction modules it runs (the last stage: training.mtp_depth)


def held(st: Stage, d: Layout, level: int) -> float:
    """Parameters of stage `st` one GPU holds: its tensor-parallel shard (experts: the expert grid's
    etp x ep), divided by the data-parallel group (dp_shard x cp; experts: edp) where the layout's
    ZeRO shards at `level` (1 the optimizer's state, 2 also gradients, 3 also weights)."""
    dense = (st.params - st.expert_params) / max(d.tp, 1)
    expert = st.expert_params / max(d.etp * d.ep, 1)
    if d.zero < level:
        return dense + expert
    return dense / max(d.dp_shard * d.cp, 1) + expert / max(d.edp, 1)


def buffer_grad_bytes(stack) -> float:
    """Bytes per element of the gradient buffer a GPU holds (stack.grad_bytes; Megatron's fp32 main
    gradients: 4); 2 where unset or not a number (validate.LIMITS bounds it, 0 .. 16)."""
    g = getattr(stack, "grad_bytes", 2.0)
    try:
        g = float(g)
    except (TypeError, ValueError):
        return 2.0
    return min(max(g, 0.0), 16.0) if g == g and abs(g) != float("inf") else 2.0


def reduce_grad_bytes(stack) -> float:
    """Bytes per gradient element the data-parallel reduction moves (stack.grad_reduce_bytes, else
    grad_bytes; 0 or unset: 2)."""
    if stack is None:
        return 2.0
    g = stack.grad_reduce_bytes if stack.grad_reduce_bytes is not None else stack.grad_bytes
    return g or 2.0


def _frac(recompute: Recompute, recompute_layers, layers: int, chunks: int) -> float:
    """The share of a stage's layers recomputed in full: all of them, or `recompute_layers`
    per model chunk (Megatron's block method)."""
    if recompute != Recompute.full:
        return 0.0
    if recompute_layers is None or not isinstance(recompute_layers, int) or isinstance(recompute_layers, bool):
        return 1.0
    return min(max(recompute_layers, 0) * chunks / max(layers, 1), 1.0)


def build_stages(mm: ModelMath, d: Layout, seq_len: int, recompute: Recompute, flash: bool,
                 attention_flops: bool, selective: Selective = Selective.orchestrator, recompute_layers=None,
                 mtp: int = 0) -> list[Stage]:
    """`selective`: what selective recompute recomputes (stack.selective; model.py);
    `recompute_layers`: with recompute=full, how many layers of each chunk (None: all);
    `mtp`: multi-token prediction modules on the last stage (training.mtp_depth)."""
    full = 1.0 if recompute == Recompute.full else 0.0
    mtp = min(max(mtp, 0), 16) if isinstance(mtp, int) and not isinstance(mtp, bool) else 0
    stages = _build(mm, d, seq_len, recompute, flash, attention_flops, selective, full, mtp)
    if not full or recompute_layers is None:
        return stages
    kept = _build(mm, d, seq_len, Recompute.none, flash, attention_flops, selective, 0.0, mtp)
    out = []
    for st, no in zip(stages, kept):
        f = _frac(recompute, recompute_layers, len(st.layers), d.chunks)
        out.append(replace(st, recompute_frac=f, hw_flops_tok=f * st.hw_flops_tok + (1 - f) * no.hw_flops_tok,
                           act_tok=f * st.act_tok + (1 - f) * no.act_tok,
                           act_tok_layer_max=st.act_tok_layer_max if f > 0 else 0.0))
    return out


def _build(mm: ModelMath, d: Layout, seq_len: int, recompute: Recompute, flash: bool, attention_flops: bool,
           selective: Selective, frac: float, mtp: int = 0) -> list[Stage]:
    tab = mm.table(seq_len, recompute, flash, attention_flops, selective)
    ranges = d.virtual_stages()
    last_stage = len(ranges) - 1
    V, h = mm.V, mm.h
    stages = []
    for r in range(d.pp):
        mine = d.schedule.stages_of_rank(r, d.pp, d.vp)
        spans = [ranges[j] for j in mine]

        def total(prefix: list) -> float:
            return sum(prefix[b] - prefix[a] for a, b in spans)

        params, model, hw = total(tab.params), total(tab.model), total(tab.hw)
        first, last = 0 in mine, last_stage in mine
        # Embedding and output layer: 6 x their parameters per token (the 6N convention).
        if first:
            params += mm.embed_params
            if mm.output_params:  # untied input embedding: counted on the first stage
                model += 6.0 * mm.embed_params
                hw += 6.0 * mm.embed_params
        expert, act, moe = total(tab.expert), total(tab.act), int(total(tab.moe))
        if last:
            params += (mm.output_params or (mm.embed_params if d.pp > 1 else 0)) + h
            model += 6.0 * V * h
            hw += 6.0 * V * h
        if last and mtp:
            # DeepSeek-V3's MTP module (Sec. 2.2): a block like the last one, a 2h -> h projection,
            # the shared output head again; hardware FLOPs, not model FLOPs.
            L = mm.L
            one = lambda prefix: prefix[L] - prefix[L - 1]  # noqa: E731
            proj = 2 * h * h + 2 * h
            params += mtp * (one(tab.params) + proj)
            expert += mtp * one(tab.expert)
            hw += mtp * (one(tab.hw) + 6.0 * proj + 6.0 * V * h)
            act += mtp * (one(tab.act) + 4.0 * h)
            moe += mtp * int(one(tab.moe))
        layers = tuple(i for a, b in spans for i in range(a, b))
        stages.append(Stage(
            index=r, layers=layers, moe_layers=moe, params=params,
            expert_params=expert, model_flops_tok=model, hw_flops_tok=hw, act_tok=act,
            act_tok_layer_max=max((tab.act_none_per_layer[i] for i in layers), default=0.0),
            embeds=first, outputs=last, recompute_frac=frac, mtp=mtp if last else 0,
        ))
    return stages
