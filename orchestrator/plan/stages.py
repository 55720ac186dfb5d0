"""Per pipeline stage: which layers, how many parameters, FLOPs and activation bytes.

Both the byte inventory and the step-time model read these; the first and last
stage also hold the embedding and the output layer, which is why Llama 3 gave
them one layer fewer.
"""
from __future__ import annotations

from dataclasses import dataclass

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


def build_stages(mm: ModelMath, d: Layout, seq_len: int, recompute: str, flash: bool,
                 attention_flops: bool) -> list[Stage]:
    tab = mm.table(seq_len, recompute, flash, attention_flops)
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
        if last:
            params += (mm.output_params or (mm.embed_params if d.pp > 1 else 0)) + h
            model += 6.0 * V * h
            hw += 6.0 * V * h
        layers = tuple(i for a, b in spans for i in range(a, b))
        stages.append(Stage(
            index=r, layers=layers, moe_layers=int(total(tab.moe)), params=params,
            expert_params=total(tab.expert), model_flops_tok=model, hw_flops_tok=hw, act_tok=total(tab.act),
            act_tok_layer_max=max((tab.act_none_per_layer[i] for i in layers), default=0.0),
            embeds=first, outputs=last,
        ))
    return stages
