"""Console line per log interval and TensorBoard scalars, from the job's leading rank (the
first rank of the current generation: after an in-place failover that may change)."""
from __future__ import annotations

import logging
from pathlib import Path

from orchestrator import rundir

log = logging.getLogger(__name__)


class Logger:
    def __init__(self, run_dir: Path, plan):  # a RunPlan
        self.run_dir, self.plan = run_dir, plan
        self.writer = None

    def _open(self):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(self.run_dir / rundir.TENSORBOARD))
        md = self.run_dir / rundir.PLAN_MD
        if md.exists():
            self.writer.add_text("plan", md.read_text().replace("\n", "  \n"), 0)

    def step(self, step: int, steps: int, values: dict, line: bool, enabled: bool) -> None:
        if not enabled:
            return
        if self.writer is None:
            self._open()
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)
        if line:
            eta = values["time/step_s"] * (steps - step - 1)
            norm = f" | grad norm {values['grad/norm']:.3g}" if "grad/norm" in values else ""
            log.info(f"step {step + 1}/{steps} | loss {values['loss/train']:.4f}{norm} | {values['time/step_s']:.3f} s/step | "
                     f"{values['throughput/tokens_per_s']:,.0f} tok/s | MFU {values['perf/mfu']:.2%} "
                     f"(plan {values['perf/mfu_predicted']:.2%}{self._not_predicted()}) | ETA {eta:.0f} s")

    def _not_predicted(self) -> str:
        """Said beside the plan's figure when the plan says it is no prediction for this layout or
        machine (plan.json's `prediction`, plan/machine.py; its warnings say why)."""
        data = getattr(self.plan, "data", None) or {}
        prediction = data.get("prediction") if isinstance(data, dict) else None
        if prediction and not prediction.get("is_prediction", True):
            return ", not a prediction for this layout here: see plan.json's prediction"
        return ""

    def close(self) -> None:
        if self.writer:
            self.writer.flush()
            self.writer.close()
