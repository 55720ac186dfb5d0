"""What the runtime (orchestrator/train) can train, checked before anything is launched.

The dry launcher plans anything the physics allows; a launcher that starts the runtime
refuses, naming what is missing, a model or layout the runtime would fail on.
"""
from __future__ import annotations

from orchestrator.config.errors import Problem
from orchestrator.config.schema import Config, MLP, Precision
from orchestrator.plan.layout import Layout


def runtime_problems(spec: Config, layout: Layout) -> list[Problem]:
    m, tr = spec.model, spec.training
    out = []
    launcher = spec.launcher.name.value
    if not spec.stack.runtime:
        out.append(Problem("stack", f"stack={spec.stack.name} plans a run as {spec.stack.name} trains it; "
                           f"launcher={launcher} starts this project's own runtime.",
                           "use stack=orchestrator to train here, or launcher=dry to plan for that stack."))
    if layout.schedule.torch_class is None:
        runnable = "dualpipev" if layout.schedule.name == "dualpipe" else "1f1b"
        out.append(Problem("schedule.name", f"the runtime cannot run schedule={layout.schedule.name} "
                           f"({layout.schedule.summary}); launcher={launcher} needs a torch.distributed.pipelining "
                           f"schedule.", f"use schedule={runnable}, or launcher=dry to plan it."))
    if m.moe.experts:
        out.append(Problem("model.moe.experts", f"{m.name} is a mixture of experts; the runtime trains dense "
                           f"models only.", "use launcher=dry to plan it, or a dense model."))
    if m.mlp != MLP.swiglu:
        out.append(Problem("model.mlp", f"the runtime trains SwiGLU MLPs; {m.name} has mlp={m.mlp.value}.",
                           "use launcher=dry to plan it, or model.mlp=swiglu."))
    if m.mla.kv_lora_rank:
        out.append(Problem("model.mla", f"{m.name} uses multi-head latent attention, which the runtime does not "
                           f"implement.", "use launcher=dry to plan it, or model.mla.kv_lora_rank=0."))
    if tr.precision == Precision.fp8:
        out.append(Problem("training.precision", "the runtime trains in bf16 (fp32 on CPU), not fp8.",
                           "use training.precision=bf16, or launcher=dry to plan fp8."))
    return out
