"""Pipeline parallelism with `torch.distributed.pipelining`: this rank's stages (cut by
parallel.py as plan.json lists them) run by the schedule class the registry names.

Its own module because importing torch's pipelining costs about 0.6 s (it pulls in
torch._dynamo): a run without pipeline parallelism never imports it, and the fork server
imports it once for a run with it."""
from __future__ import annotations

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as S

from orchestrator.config.schedules import SCHEDULES
from orchestrator.rundir.plan import RunPlan
from orchestrator.train.moe import TRAFFIC


class _Stage(PipelineStage):
    """torch's stage, with the forward and backward it runs once to infer shapes left out of
    the expert load and traffic counts (moe.Traffic)."""

    def _forward_metadata_inference(self, *args, **kwargs):
        with TRAFFIC.uncounted():
            return super()._forward_metadata_inference(*args, **kwargs)

    def _backward_metadata_inference(self, *args, **kwargs):
        with TRAFFIC.uncounted():
            return super()._backward_metadata_inference(*args, **kwargs)


def build_schedule(plan: RunPlan, parts, mesh, device: torch.device, loss_fn, microbatches: int | None = None,
                   scale_grads: bool = True):
    """The plan's pipelining schedule over this rank's chunks (torch's class, by registry name), for
    the plan's micro-batch count or `microbatches` (a recovery pass: the lost copies' micro-batches;
    train/trainer.py). Some classes take no fewer micro-batches than stages (torch 2.13: Schedule1F1B
    and ScheduleDualPipeV raise ValueError below the stage count); such a count is raised to the
    stage count, then to the plan's, the rest run as padding micro-batches. (schedule, stages, the
    count it runs). `scale_grads`: torch divides every gradient by the count at the end (False: the
    loss carries the weight, and gradients already held are left as they are)."""
    lay = plan.layout
    cls = getattr(S, SCHEDULES[lay["schedule"]].torch_class)
    wanted = lay["microbatches"] if microbatches is None else microbatches
    tries = sorted({wanted, max(wanted, lay["num_stages"]), max(wanted, lay["microbatches"])})
    for i, n in enumerate(tries):
        stages = [_Stage(part, s, lay["num_stages"], device, group=mesh["pp"].get_group()) for s, part in parts]
        first = stages if issubclass(cls, S.PipelineScheduleMulti) else stages[0]
        try:
            return cls(first, n_microbatches=n, loss_fn=loss_fn, scale_grads=scale_grads), stages, n
        except ValueError:
            if i == len(tries) - 1:
                raise
    raise AssertionError("unreachable")
