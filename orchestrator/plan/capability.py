"""What the runtime (orchestrator/train) can train, checked before anything is launched.

The dry launcher plans anything the physics allows; a launcher that starts the runtime
refuses, naming what is missing, a model or layout the runtime would fail on.
"""
from __future__ import annotations

from orchestrator.config.errors import Problem
from orchestrator.config.schema import Config, Precision, TrainerName
from orchestrator.plan.layout import Layout


def runtime_problems(spec: Config, layout: Layout) -> list[Problem]:
    m, tr = spec.model, spec.training
    out = []
    launcher = spec.launcher.name.value
    if spec.trainer.name != TrainerName.orchestrator:  # an external trainer: its own limits (frameworks/trainers.py)
        from orchestrator.frameworks.trainers import trainer_problems

        return trainer_problems(spec, layout)
    if not spec.stack.runtime:
        out.append(Problem("stack", f"stack={spec.stack.name} plans a run as {spec.stack.name} trains it; "
                           f"launcher={launcher} starts this project's own runtime.",
                           "use stack=orchestrator to train here, trainer=torchtitan or trainer=megatron to launch "
                           "that framework, trainer=command for your own program, or launcher=dry to plan."))
    if layout.schedule.torch_class is None:
        runnable = "dualpipev" if layout.schedule.name == "dualpipe" else "1f1b"
        out.append(Problem("schedule.name", f"the runtime cannot run schedule={layout.schedule.name} "
                           f"({layout.schedule.summary}); launcher={launcher} needs a torch.distributed.pipelining "
                           f"schedule.", f"use schedule={runnable}, or launcher=dry to plan it."))
    if spec.stack.runtime and layout.zero < 2:
        what = "replicated state, DDP" if layout.zero == 0 else "only the optimizer state sharded"
        out.append(Problem("layout.zero", f"the runtime shards weights, gradients and optimizer state with FSDP2 "
                           f"(zero=3: weights re-gathered for backward; zero=2: kept gathered from forward to "
                           f"backward); zero={layout.zero} ({what}) is not implemented.",
                           "use layout.zero=2 (replicated weights during the step, as zero=0/1 hold them) or "
                           "layout.zero=3, or launcher=dry to plan it."))
    if spec.stack.runtime and layout.cp > 1 and spec.stack.cp_comm.value != "all_gather":
        out.append(Problem("stack.cp_comm", f"the runtime's context parallelism all-gathers K and V along the "
                           f"sequence (orchestrator/train/model.py _GatherSeq; reduced back in the backward), not "
                           f"{spec.stack.cp_comm.value}.", f"set stack.cp_comm=all_gather, or launcher=dry to plan "
                           f"{spec.stack.cp_comm.value}."))
    if spec.stack.runtime and spec.stack.cross_entropy.value != "torch":
        out.append(Problem("stack.cross_entropy", f"the runtime's loss is torch's cross_entropy on fp32 logits, eager "
                           f"(orchestrator/train/trainer.py loss_fn), not {spec.stack.cross_entropy.value}'s kernels.",
                           f"set stack.cross_entropy=torch, or launcher=dry to plan "
                           f"{spec.stack.cross_entropy.value}."))
    if layout.chunk_layers is not None:
        out.append(Problem("stack.pipeline_accounting", f"the embedding and the loss take a layer's place in "
                           f"the pipeline split ({spec.stack.pipeline_accounting.value}); the runtime fills its "
                           f"stages with transformer layers only.",
                           "set stack.pipeline_accounting=layers, or launcher=dry to plan it."))
    if tr.mtp_depth:
        out.append(Problem("training.mtp_depth", f"the runtime trains no multi-token prediction modules "
                           f"(mtp_depth={tr.mtp_depth}).", "set training.mtp_depth=0, or launcher=dry to plan MTP."))
    if m.moe.experts:
        if layout.etp > 1:
            out.append(Problem("layout.etp", f"the runtime runs experts without tensor parallelism (etp=1: each "
                               f"tensor rank routes its sequence shard); layout.etp={layout.etp}.",
                               "set layout.etp=1, or launcher=dry to plan expert tensor parallelism."))
        if layout.dp_replicate > 1:
            out.append(Problem("layout.dp_shard", f"copies of the state (dp {layout.dp} / dp_shard "
                               f"{layout.dp_shard}) are for dense models in the runtime; {m.name} has experts.",
                               "leave layout.dp_shard unset (one copy: a node loss re-plans on the survivors "
                               "and restarts)."))
        if m.moe.max_nodes_per_token:
            out.append(Problem("model.moe.max_nodes_per_token", "the runtime routes without a node limit.",
                               "set model.moe.max_nodes_per_token=0, or launcher=dry to plan node-limited routing."))
    if m.tied_embeddings and layout.pp > 1:
        out.append(Problem("model.tied_embeddings", f"the embedding and the output head are on different pipeline "
                           f"stages (pp={layout.pp}); the runtime ties them only inside one stage.",
                           "set model.tied_embeddings=false, or layout.pp=1."))
    if m.mla.kv_lora_rank:
        out.append(Problem("model.mla", f"{m.name} uses multi-head latent attention, which the runtime does not "
                           f"implement.", "use launcher=dry to plan it, or model.mla.kv_lora_rank=0."))
    if tr.precision not in (Precision.bf16, Precision.fp32):
        out.append(Problem("training.precision", f"the runtime trains in bf16 (fp32 on CPU), not "
                           f"{tr.precision.value}.", f"use training.precision=bf16, or launcher=dry to plan "
                           f"{tr.precision.value}."))
    return out
