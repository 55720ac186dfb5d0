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
    stages = []
    start = 0
    V, h = mm.V, mm.h
    for i, n in enumerate(d.stage_layers):
        idx = tuple(range(start, start + n))
        start += n
        first, last = i == 0, i == d.pp - 1
        params = sum(mm.layer(j).params for j in idx)
        expert = sum(mm.layer(j).expert_params for j in idx)
        fl = [mm.layer_flops(j, seq_len, attention_flops, recompute) for j in idx]
        model = sum(f[0] for f in fl)
        hw = sum(f[1] for f in fl)
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
        acts = [mm.layer_act_bytes(j, seq_len, recompute, flash) for j in idx]
        stages.append(Stage(
            index=i, layers=idx,
            moe_layers=sum(1 for j in idx if mm.layer(j).expert_params),
            params=params, expert_params=expert, model_flops_tok=model, hw_flops_tok=hw,
            act_tok=sum(acts),
            act_tok_layer_max=max((mm.layer_act_bytes(j, seq_len, "none", flash) for j in idx), default=0.0),
            embeds=first, outputs=last,
        ))
    return stages
