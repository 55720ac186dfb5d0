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


def build_schedule(plan: RunPlan, parts, mesh, device: torch.device, loss_fn):
    """The plan's pipelining schedule over this rank's chunks (torch's class, by registry name)."""
    lay = plan.layout
    stages = [_Stage(part, i, lay["num_stages"], device, group=mesh["pp"].get_group()) for i, part in parts]
    cls = getattr(S, SCHEDULES[lay["schedule"]].torch_class)
    first = stages if issubclass(cls, S.PipelineScheduleMulti) else stages[0]
    return cls(first, n_microbatches=lay["microbatches"], loss_fn=loss_fn), stages
