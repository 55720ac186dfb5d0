"""Megatron-LM's layout rules, written down as Megatron states them, for the differential
test (test_megatron_rules.py). Pure Python, independent of the planner. (The process groups
themselves are checked against megatron-core's own code: tests/megatron_core.py.)

Sources (NVIDIA/Megatron-LM main, d98e8a64dd; line numbers there):
  ps.py  = megatron/core/parallel_state.py (initialize_model_parallel, RankGenerator)
  args.py = megatron/training/arguments.py (validate_args)
  tc.py  = megatron/core/transformer/transformer_config.py (TransformerConfig.__post_init__)
  sch.py = megatron/core/pipeline_parallel/schedules.py
  nmc.py = megatron/core/num_microbatches_calculator.py
Each rule below is a predicate on one layout that is True when Megatron refuses it.
Nothing here is copied from Megatron. The two rules on the rank order are Megatron-Core's own
initialize_model_parallel, run by the test (tests/megatron_core.py) on each layout.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


# ---- one layout, in Megatron's terms ----
@dataclass
class Case:
    world: int
    gpn: int
    tp: int
    cp: int
    pp: int
    ep: int
    etp: int | None  # None: Megatron's default (tp)
    vp: int  # 1: no interleaving
    order: str  # "tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp", or any permutation (initialize_model_parallel's order)
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    experts: int
    expert_ffn: int
    shared: int
    dense_layers: int
    seq: int
    global_batch: int
    micro_batch: int
    sp: bool
    interleaved_schedule: bool = False  # vp == 1 with schedule=interleaved_1f1b (Megatron: no interleaving)
    extra: dict = field(default_factory=dict)

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.cp * self.pp)

    @property
    def etp_(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def m(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp)


@dataclass(frozen=True)
class Rule:
    name: str
    source: str  # the Megatron-LM line it mirrors
    keys: tuple[str, ...]  # the planner must name one of these keys when this rule refuses
    refuses: Callable[[Case], bool]
    stacks: tuple[str, ...] = ("torch", "megatron")  # where the planner applies the same rule


def _grid_ok(c: Case) -> bool:
    return c.world % (c.tp * c.cp * c.pp) == 0 and c.world % (c.etp_ * c.ep * c.pp) == 0


def _core_refuses(c: Case, says: str) -> bool:
    """Megatron-Core's own initialize_model_parallel (run by the test on this layout's sizes and
    order: c.extra["core"], its refusal or None) refused it, saying `says`. (Its two generators'
    pipeline groups, compared by its RankGenerator whatever refused first: c.extra["core_pp_differ"].)"""
    return says in (c.extra.get("core") or "")


def _widths(c: Case) -> list[tuple[int, int]]:
    out = []
    if not c.experts or c.dense_layers:
        out.append((c.ffn, c.tp))
    if c.experts:
        out.append((c.expert_ffn, c.etp_))
        if c.shared:
            out.append((c.shared * c.expert_ffn, c.tp))
    return out


def _batch_ok(c: Case) -> bool:
    return _grid_ok(c) and c.global_batch % (c.micro_batch * c.dp) == 0


RULES: list[Rule] = [
    Rule("world % (tp cp pp)", "ps.py:815-823; args.py:425-434", ("layout.tp", "layout.cp", "layout.pp",
         "cluster.nodes"), lambda c: c.world % (c.tp * c.cp * c.pp) != 0),
    Rule("interleaving needs pp > 1", "ps.py:827-831 (RuntimeError); args.py:1000-1010", ("layout.vp",),
         lambda c: c.vp > 1 and c.pp == 1),
    Rule("world % (etp ep pp)", "ps.py:874-884 (RuntimeError)", ("layout.ep", "layout.etp"),
         lambda c: c.world % (c.etp_ * c.ep * c.pp) != 0),
    Rule("order ends with pp, or pp == 1, or edp == dp", "megatron-core 0.16.1 parallel_state.py:808-812, run",
         ("layout.order",), lambda c: _core_refuses(c, "When not using pp-last rank ordering"), stacks=("megatron",)),
    Rule("dense and expert pipeline groups agree", "megatron-core 0.16.1 parallel_state.py:775-817, run",
         ("layout.order",), lambda c: bool(c.extra.get("core_pp_differ"))),
    Rule("ep > 1 needs experts", "args.py:1654-1658", ("layout.ep",), lambda c: c.ep > 1 and not c.experts),
    Rule("experts % ep", "args.py:1654-1658; moe_layer.py:186", ("layout.ep",),
         lambda c: bool(c.experts) and c.experts % c.ep != 0),
    Rule("heads % tp", "tc.py:1446-1450 (ValueError)", ("layout.tp",), lambda c: c.heads % c.tp != 0),
    Rule("kv heads a multiple or a divisor of tp", "tc.py:1458-1468 (ValueError)", ("model.kv_heads",),
         lambda c: c.kv_heads % c.tp != 0 and c.tp % c.kv_heads != 0),
    Rule("MLP widths divide over (e)tp", "tensor_parallel/layers.py:1038,1408 (divide asserts)",
         ("model.ffn_hidden", "model.moe.expert_ffn_hidden"),
         lambda c: any(w % d for w, d in _widths(c)), stacks=("megatron",)),
    Rule("MoE with tp > 1 needs sequence parallelism", "transformer/moe/moe_layer.py:636-640 (ValueError)",
         ("layout.sequence_parallel",), lambda c: bool(c.experts) and c.tp > 1 and not c.sp, stacks=("megatron",)),
    Rule("cp > 1: seq % (2 cp)", "args.py:1335-1338", ("training.seq_len",),
         lambda c: c.cp > 1 and c.seq % (2 * c.cp) != 0),
    Rule("sequence parallelism splits each CP rank's tokens over tp",
         "tensor_parallel/mappings.py _split_along_first_dim (assert)", ("training.seq_len",),
         lambda c: c.sp and c.tp > 1 and c.seq % (2 * c.cp if c.cp > 1 else 1) == 0 and (c.seq // c.cp) % c.tp != 0),
    Rule("layers % pp, and % vp per rank", "args.py:985-998; tc.py:2347-2368", ("model.layers",),
         lambda c: c.layers % c.pp != 0 or (c.vp > 1 and (c.layers // c.pp) % c.vp != 0)),
    Rule("global batch % (micro batch x dp)", "nmc.py:367-392", ("training.global_batch",),
         lambda c: c.world % (c.tp * c.cp * c.pp) == 0 and c.global_batch % (c.micro_batch * c.dp) != 0),
    Rule("interleaving: pp <= m and m % pp == 0", "sch.py:1160-1180 (ValueError, RuntimeError)",
         ("training.global_batch",),
         lambda c: c.vp > 1 and c.pp > 1 and _batch_ok(c) and (c.m < c.pp or c.m % c.pp != 0),
         stacks=("megatron",)),
]

# What Megatron runs but warns about (the plan says it with the bubble's cost):
WARNINGS: list[Rule] = [
    Rule("1F1B with fewer micro-batches than stages runs, warm-up capped at m", "sch.py:2277-2279", (),
         lambda c: c.vp == 1 and c.pp > 1 and _batch_ok(c) and c.m < c.pp, stacks=("megatron",)),
]

# torch.distributed.pipelining (stack.pipeline_rules=torch), torch 2.13: the rules that take the
# place of Megatron's schedule rules for this project's runtime.
TORCH_RULES: list[Rule] = [
    Rule("Schedule1F1B: m >= pp", "torch/distributed/pipelining/schedules.py Schedule1F1B.__init__",
         ("training.global_batch",),
         lambda c: not c.interleaved_schedule and c.pp > 1 and _batch_ok(c) and c.m < c.pp, stacks=("torch",)),
    Rule("ScheduleInterleaved1F1B: m % max(1, m // pp) == 0",
         "torch/distributed/pipelining/schedules.py ScheduleInterleaved1F1B.__init__", ("training.global_batch",),
         lambda c: c.interleaved_schedule and c.pp > 1 and _batch_ok(c) and c.m % max(1, c.m // c.pp) != 0,
         stacks=("torch",)),
]


def refusals(c: Case, stack: str = "megatron") -> list[Rule]:
    """The rules that refuse this layout under stack.pipeline_rules=`stack`: Megatron's as it
    states them, or, for torch, the rules every stack shares plus torch's schedule rules
    (a dense model's expert grid is not built there, so its etp is not checked)."""
    if stack == "megatron":
        return [r for r in RULES if r.refuses(c)]
    out = [r for r in RULES if "torch" in r.stacks and r.refuses(c)]
    if not c.experts:  # no expert grid for a dense model outside Megatron
        out = [r for r in out if r.name not in ("world % (etp ep pp)", "dense and expert pipeline groups agree")]
    return out + [r for r in TORCH_RULES if r.refuses(c)]
