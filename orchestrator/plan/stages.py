"""Per pipeline stage: which layers, how many parameters, FLOPs and activation bytes.

Both the byte inventory and the step-time model read these; the first and last
stage also hold the embedding and the output layer, which is why Llama 3 gave
them one layer fewer.
"""
from __future__ import annotations

from dataclasses import dataclass

from orchestrator.plan.model import ModelMath
from orchestrator.plan.validate import Degrees


@dataclass(frozen=True)
class Stage:
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


def build_stages(mm: ModelMath, d: Degrees, seq_len: int, recompute: str, flash: bool,
                 attention_flops: bool) -> list[Stage]:
    tab = mm.table(seq_len, recompute, flash, attention_flops)
    stages = []
    start = 0
    V, h = mm.V, mm.h
    for i, n in enumerate(d.stage_layers):
        a, b = start, start + n
        start = b
        first, last = i == 0, i == d.pp - 1
        params = tab.params[b] - tab.params[a]
        model = tab.model[b] - tab.model[a]
        hw = tab.hw[b] - tab.hw[a]
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
        stages.append(Stage(
            index=i, layers=tuple(range(a, b)), moe_layers=tab.moe[b] - tab.moe[a],
            params=params, expert_params=tab.expert[b] - tab.expert[a], model_flops_tok=model, hw_flops_tok=hw,
            act_tok=tab.act[b] - tab.act[a], act_tok_layer_max=max(tab.act_none_per_layer[a:b], default=0.0),
            embeds=first, outputs=last,
        ))
    return stages
