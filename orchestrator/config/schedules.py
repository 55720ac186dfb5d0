"""Pipeline schedules: one entry each, read by the schema, the planner and the runtime.

An entry says everything layout-shaped about a schedule: how many model chunks
(virtual stages) each pipeline rank runs and where they sit, its bubble in units of
one micro-batch on the slowest stage, how many micro-batches of activations a stage
holds at its peak, how many copies of the weights it keeps, which micro-batch counts
each software stack's implementation accepts (one rule per stack, `stack.pipeline_rules`),
and the `torch.distributed.pipelining.schedules` class the runtime builds (by name, so
planning never imports torch). Adding a schedule is one
entry here (the config group option `schedule=NAME` is generated from it) and its test.

Sources: GPipe (Huang et al. 2019); 1F1B and interleaved 1F1B (Narayanan et al. 2021);
zero bubble (Qi et al. 2024, ZB-H1: about a third of 1F1B's bubble); DualPipe and
DualPipeV (DeepSeek-V3, Sec. 3.2.1 and Table 2; DeepSeek's DualPipeV "cut-in-half"
variant keeps one copy of the weights). Activations in flight: Korthikanti et al. 2022.
Micro-batch rules, as strict as each framework and no stricter (each rule below cites the
function it mirrors):
- torch (stack.pipeline_rules=torch: this runtime, torchtitan), torch/distributed/pipelining/
  schedules.py as of torch 2.13: Schedule1F1B and ScheduleDualPipeV raise below the number of
  stages; ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble need n_microbatches %
  max(1, n_microbatches // pp) == 0; ScheduleGPipe checks nothing (its check was removed by
  pytorch/pytorch#171462).
- megatron (stack.pipeline_rules=megatron), megatron/core/pipeline_parallel/schedules.py:
  1F1B caps its warm-up at the micro-batch count and runs below pp (a warning with the bubble
  cost); interleaving needs pp <= m and m % pp == 0 (the default micro-batch group of pp).
  Megatron-Core has no GPipe, zero-bubble or DualPipe schedule: for those the rule of the
  implementation the plan names applies whatever the stack (torch's, DeepSeek's DualPipe).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


Check = Callable[[int, int, int], "str | None"]  # (pp, chunks, m) -> what is wrong, or None


def _ok(pp: int, chunks: int, m: int) -> str | None:
    return None


@dataclass(frozen=True)
class MicrobatchRule:
    """One implementation's rule on the number of micro-batches m for pp ranks of `chunks`
    model chunks each. `refuse` says why the implementation would not start; `warn` says
    why it starts but runs badly (the plan prices it: the bubble is in the step time)."""

    stack: str  # the stack.pipeline_rules it belongs to: torch | megatron
    source: str  # the file and function it mirrors
    refuse: Check = _ok
    warn: Check = _ok

    def smallest_m(self, pp: int, chunks: int, m: int) -> int | None:
        """The smallest micro-batch count above m this rule accepts (None: no count does)."""
        start = m + 1
        for lo in (start, pp * chunks, 2 * pp * chunks):
            for x in range(max(lo, start), max(lo, start) + 2 * pp + 2):
                if self.refuse(pp, chunks, x) is None:
                    return x
        return None


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
    # The micro-batch counts the schedule accepts, per stack.pipeline_rules (torch | megatron)
    rules: tuple[MicrobatchRule, ...] = ()

    def rule(self, stack: str) -> MicrobatchRule:
        """The micro-batch rule of this schedule under stack.pipeline_rules=`stack`."""
        for r in self.rules:
            if r.stack == stack:
                return r
        return MicrobatchRule(stack, "no rule")

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
    """Korthikanti et al.'s pp - stage micro-batches x (1 + (pp-1)/(pp vp)), at most all m of them: both
    torch's and Megatron's warmup stop at every chunk's forward of every micro-batch (torch:
    _get_warmup_ops caps the warmup at n_microbatches x n_local_stages; Megatron-Core: at
    num_microbatches x num_model_chunks), so with m = pp the first rank holds m, not 1.44 m."""
    held = float(min(pp - stage, m))
    return min(held * (1.0 + (pp - 1) / (pp * vp)), float(m)) if vp > 1 else held


def _stages_txt(pp: int, chunks: int) -> str:
    return f"pp={pp}" if chunks == 1 else f"{chunks} x pp={pp} = {chunks * pp}"


def _at_least_stages(pp: int, chunks: int, m: int) -> str | None:
    """torch: Schedule1F1B.__init__ and ScheduleDualPipeV.__init__ raise ValueError when
    n_microbatches < the number of stages (torch/distributed/pipelining/schedules.py)."""
    if m >= pp * chunks:
        return None
    return f"needs at least {_stages_txt(pp, chunks)} micro-batches (one per stage), got {m}"


def _torch_rounds(pp: int, chunks: int, m: int) -> str | None:
    """torch: ScheduleInterleaved1F1B.__init__ and ScheduleInterleavedZeroBubble.__init__ run
    micro-batches in max(1, m // pp) rounds and raise ValueError unless m is a multiple of
    that (torch/distributed/pipelining/schedules.py); fewer than pp is one round and runs."""
    rounds = max(1, m // pp)
    if m % rounds == 0:
        return None
    return (f"runs micro-batches in max(1, m // pp) = {rounds} rounds: {m} is not a multiple of {rounds} "
            f"(any m < {2 * pp} or a multiple of pp={pp} works)")


def _megatron_fewer_than_pp(pp: int, chunks: int, m: int) -> str | None:
    """Megatron-Core: forward_backward_pipelining_without_interleaving caps the warm-up at
    min(pp - rank - 1, m) (megatron/core/pipeline_parallel/schedules.py:2278) and runs; the
    missing steady state is bubble. Also what it runs for vp=1 (megatron/training/arguments.py
    :978-979 turns vp=1 into no interleaving)."""
    if m >= pp:
        return None
    return f"has {m} micro-batches for pp={pp} stages: the warm-up never fills the pipeline"


def _megatron_interleaved(pp: int, chunks: int, m: int) -> str | None:
    """Megatron-Core: forward_backward_pipelining_with_interleaving raises ValueError unless
    pp <= microbatch_group_size_per_vp_stage (default pp, megatron/core/model_parallel_config.py
    :567-568) <= m, and RuntimeError when 0 < m % pp < pp (megatron/core/pipeline_parallel/
    schedules.py:1160-1180): with the default group, m >= pp and m % pp == 0."""
    if chunks == 1:  # vp=1 is no interleaving in Megatron: the 1F1B rule (a warning)
        return None
    if m < pp:
        return f"needs at least pp={pp} micro-batches (one group of pp per virtual stage), got {m}"
    if m % pp:
        return f"runs micro-batches in groups of pp: {m} is not a multiple of pp={pp}"
    return None


def _megatron_interleaved_warn(pp: int, chunks: int, m: int) -> str | None:
    return _megatron_fewer_than_pp(pp, chunks, m) if chunks == 1 else None


def _dualpipe(pp: int, chunks: int, m: int) -> str | None:
    """DeepSeek's DualPipe.step (deepseek-ai/DualPipe, dualpipe/dualpipe.py) asserts an even
    number of ranks and an even number of micro-batches, at least 2 x pp (half are fed from
    each end). Megatron-Core and torch have no DualPipe: this rule holds for every stack."""
    if pp % 2:
        return f"feeds micro-batches from both ends of the pipeline: it needs an even pp, got pp={pp}"
    if m < 2 * pp or m % 2:
        return f"feeds half the micro-batches from each end: it needs an even m >= 2 x pp = {2 * pp}, got {m}"
    return None


TORCH = "torch/distributed/pipelining/schedules.py"
MEGATRON = "megatron/core/pipeline_parallel/schedules.py"
DUALPIPE = "deepseek-ai/DualPipe dualpipe/dualpipe.py DualPipe.step"


def _both(source: str, refuse: Check = _ok) -> tuple[MicrobatchRule, ...]:
    """A schedule Megatron-Core does not implement: its own implementation's rule, whatever the stack."""
    return (MicrobatchRule("torch", source, refuse),
            MicrobatchRule("megatron", source + " (Megatron-Core has no such schedule)", refuse))


SCHEDULES: dict[str, ScheduleSpec] = {s.name: s for s in (
    ScheduleSpec("gpipe", "all forwards, then all backwards (GPipe)", "ScheduleGPipe", "loop", lambda vp: 1, False,
                 bubble=lambda pp, vp: pp - 1, held=lambda pp, vp, m, stage: float(m),
                 # torch: ScheduleGPipe has no __init__ check (torch 2.13; pytorch/pytorch#171462 removed it)
                 rules=_both(f"{TORCH} ScheduleGPipe")),
    ScheduleSpec("1f1b", "one forward, one backward in steady state (PipeDream-flush)", "Schedule1F1B", "loop",
                 lambda vp: 1, False, bubble=lambda pp, vp: pp - 1, held=_one_f_one_b_held,
                 rules=(MicrobatchRule("torch", f"{TORCH} Schedule1F1B.__init__", refuse=_at_least_stages),
                        MicrobatchRule("megatron", f"{MEGATRON}:2278 forward_backward_pipelining_without_"
                                       "interleaving", warn=_megatron_fewer_than_pp))),
    ScheduleSpec("interleaved_1f1b", "1F1B over vp model chunks per rank (Megatron 2021)", "ScheduleInterleaved1F1B",
                 "loop", lambda vp: vp, True, bubble=lambda pp, vp: (pp - 1) / vp, held=_interleaved_held,
                 rules=(MicrobatchRule("torch", f"{TORCH} ScheduleInterleaved1F1B.__init__", refuse=_torch_rounds),
                        MicrobatchRule("megatron", f"{MEGATRON}:1160-1180 forward_backward_pipelining_with_"
                                       "interleaving", refuse=_megatron_interleaved,
                                       warn=_megatron_interleaved_warn))),
    ScheduleSpec("zero_bubble", "ZB-H1: backward split into input and weight gradients", "ScheduleInterleavedZeroBubble",
                 "loop", lambda vp: 1, False, bubble=lambda pp, vp: (pp - 1) / 3.0, held=_one_f_one_b_held,
                 rules=_both(f"{TORCH} ScheduleInterleavedZeroBubble.__init__", _torch_rounds)),
    ScheduleSpec("dualpipe", "DeepSeek's bidirectional DualPipe (two copies of the weights); plan only",
                 None, "loop", lambda vp: 1, False, bubble=lambda pp, vp: (pp - 1) / 2.0,
                 held=lambda pp, vp, m, stage: float(min(pp + 1, m)), weight_copies=2, overlaps_ep=True,
                 rules=_both(DUALPIPE, _dualpipe)),
    ScheduleSpec("dualpipev", "DualPipeV: DualPipe cut in half, two chunks per rank in a V, one weight copy",
                 "ScheduleDualPipeV", "v", lambda vp: 2, False, bubble=lambda pp, vp: (pp - 1) / 2.0,
                 held=lambda pp, vp, m, stage: float(min(pp + 1, m)), overlaps_ep=True,
                 # torch's ScheduleDualPipeV.__init__ (DeepSeek's DualPipeV.step asserts the same, m >= 2 x pp)
                 rules=_both(f"{TORCH} ScheduleDualPipeV.__init__", _at_least_stages)),
)}
