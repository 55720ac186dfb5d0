"""Pipeline schedules: one entry each, read by the schema, the planner and the runtime.

An entry says everything layout-shaped about a schedule: how many model chunks
(virtual stages) each pipeline rank runs and where they sit, its bubble in units of
one micro-batch on the slowest stage, how many micro-batches of activations a stage
holds at its peak, how many copies of the weights it keeps, which micro-batch counts
torch's implementation accepts, and the `torch.distributed.pipelining.schedules` class
the runtime builds (by name, so planning never imports torch). Adding a schedule is one
entry here (the config group option `schedule=NAME` is generated from it) and its test.

Sources: GPipe (Huang et al. 2019); 1F1B and interleaved 1F1B (Narayanan et al. 2021);
zero bubble (Qi et al. 2024, ZB-H1: about a third of 1F1B's bubble); DualPipe and
DualPipeV (DeepSeek-V3, Sec. 3.2.1 and Table 2; DeepSeek's DualPipeV "cut-in-half"
variant keeps one copy of the weights). Activations in flight: Korthikanti et al. 2022.
torch's micro-batch checks: torch/distributed/pipelining/schedules.py (Schedule1F1B and
ScheduleDualPipeV raise when n_microbatches < number of stages; Interleaved1F1B and
InterleavedZeroBubble need n_microbatches % max(1, n_microbatches // pp) == 0).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class ScheduleSpec:
    name: str
    summary: str
    torch_class: str | None  # None: the runtime cannot run it (plan-only)
    placement: str  # "loop": chunk k of rank r is stage r + k*pp; "v": rank r holds r and 2pp-1-r
    chunks: Callable[[int], int]  # model chunks per rank, given layout.vp
    uses_vp: bool  # layout.vp > 1 means something for this schedule
    bubble: Callable[[int, int], float]  # (pp, vp) -> idle time in micro-batches of the slowest stage
    held: Callable[[int, int, int, int], float]  # (pp, vp, m, stage) -> micro-batches of activations held
    weight_copies: int = 1
    overlaps_ep: bool = False  # one micro-batch's all-to-all hides behind another's compute (DualPipe)
    # The micro-batch count the schedule accepts: (pp, chunks, m) -> what is wrong, or None
    check: Callable[[int, int, int], str | None] = lambda pp, chunks, m: None

    def stages(self, pp: int, vp: int) -> int:
        """Virtual stages in the whole pipeline."""
        return pp * self.chunks(vp)

    def rank_of_stage(self, stage: int, pp: int) -> int:
        if self.placement == "v":
            return stage if stage < pp else 2 * pp - 1 - stage
        return stage % pp

    def stages_of_rank(self, pp_rank: int, pp: int, vp: int) -> list[int]:
        """The virtual stages one pipeline rank runs, in the order it holds them."""
        n = self.chunks(vp)
        if self.placement == "v":
            return [pp_rank, 2 * pp - 1 - pp_rank]
        return [pp_rank + k * pp for k in range(n)]


def _one_f_one_b_held(pp: int, vp: int, m: int, stage: int) -> float:
    return float(min(pp - stage, m))  # the first stage holds pp micro-batches: a whole model's layers


def _interleaved_held(pp: int, vp: int, m: int, stage: int) -> float:
    held = float(min(pp - stage, m))
    return held * (1.0 + (pp - 1) / (pp * vp)) if vp > 1 else held


def _fill(pp: int, chunks: int, m: int) -> str | None:
    if m >= pp * chunks:
        return None
    need = f"pp={pp}" if chunks == 1 else f"{chunks} x pp={pp} = {chunks * pp}"
    return f"needs at least {need} micro-batches to fill the pipeline, got {m}"


def _rounds_of_pp(pp: int, chunks: int, m: int) -> str | None:
    return _fill(pp, 1, m) or (None if m % pp == 0 else
                                f"runs micro-batches in rounds of pp: {m} is not a multiple of pp={pp}")


def _even(pp: int, chunks: int, m: int) -> str | None:
    return _fill(pp, chunks, m) or (None if m % 2 == 0 else
                                    f"feeds micro-batches from both ends: {m} is odd")


SCHEDULES: dict[str, ScheduleSpec] = {s.name: s for s in (
    ScheduleSpec("gpipe", "all forwards, then all backwards (GPipe)", "ScheduleGPipe", "loop", lambda vp: 1, False,
                 bubble=lambda pp, vp: pp - 1, held=lambda pp, vp, m, stage: float(m)),
    ScheduleSpec("1f1b", "one forward, one backward in steady state (PipeDream-flush)", "Schedule1F1B", "loop",
                 lambda vp: 1, False, bubble=lambda pp, vp: pp - 1, held=_one_f_one_b_held,
                 check=_fill),
    ScheduleSpec("interleaved_1f1b", "1F1B over vp model chunks per rank (Megatron 2021)", "ScheduleInterleaved1F1B",
                 "loop", lambda vp: vp, True, bubble=lambda pp, vp: (pp - 1) / vp, held=_interleaved_held,
                 check=_rounds_of_pp),
    ScheduleSpec("zero_bubble", "ZB-H1: backward split into input and weight gradients", "ScheduleInterleavedZeroBubble",
                 "loop", lambda vp: 1, False, bubble=lambda pp, vp: (pp - 1) / 3.0, held=_one_f_one_b_held,
                 check=_fill),
    ScheduleSpec("dualpipe", "DeepSeek's bidirectional DualPipe (two copies of the weights); plan only",
                 None, "loop", lambda vp: 1, False, bubble=lambda pp, vp: (pp - 1) / 2.0,
                 held=lambda pp, vp, m, stage: float(min(pp + 1, m)), weight_copies=2, overlaps_ep=True,
                 check=_even),
    ScheduleSpec("dualpipev", "DualPipeV: DualPipe cut in half, two chunks per rank in a V, one weight copy",
                 "ScheduleDualPipeV", "v", lambda vp: 2, False, bubble=lambda pp, vp: (pp - 1) / 2.0,
                 held=lambda pp, vp, m, stage: float(min(pp + 1, m)), overlaps_ep=True,
                 check=_even),
)}
