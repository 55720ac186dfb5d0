"""Step-time model (seed 1): arithmetic at peak, TP collectives fully exposed, a
bubble of (p-1)/m, point-to-point sends between stages, and FSDP traffic hidden
behind backward except what sticks out. Each axis is costed on the tier its
groups actually span, so a bad rank order shows up as a slower step.

Per micro-batch on the slowest stage (the pipeline runs at its pace):
- compute: hardware FLOPs per token x s/cp x b tokens / tp / peak
- TP: 4 collectives per layer (2 forward, 2 backward; 6 with full recompute),
  each moving 2(t-1)/t x (s/cp) b h x 2 bytes (all-reduce, or AG + RS with SP)
- CP (Llama 3's all-gather CP): K and V all-gathered forward, reduce-scattered
  backward, (c-1)/c x s b x KV width x 2 bytes each
- EP: all-to-all dispatch and combine, forward and backward, (e-1)/e of the
  routed tokens' hidden states
Per step: m x the above; the bubble is the schedule's (config/schedules.py) in
micro-batches of the slowest stage: (p-1)/vp for 1F1B and GPipe (as a fraction of
the step, GPipe's (p-1)/(m+p-1), seed 2), a third of that for zero-bubble (ZB-H1),
half for DualPipe; P2P = the sends on the critical path of fill and drain,
2 (p x chunks - 1) (steady-state sends overlap); DP = weight all-gathers and
gradient reduce-scatters once per step (dense weights over dp x cp, experts over
edp), hidden behind the step's backward (2/3 of its compute) except the first gather.

`total_s` is the roofline budget. The kernels reach `kernel_efficiency` of it,
so the predicted wall-clock step is total_s / kernel_efficiency and
MFU = useful fraction x kernel efficiency (seed 1).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from orchestrator.config.schedules import SCHEDULES
from orchestrator.plan.axes import AXES, CANONICAL_ORDER
from orchestrator.plan.layout import Layout
from orchestrator.plan.model import ModelMath
from orchestrator.plan.stages import Stage
from orchestrator.plan.topology import Tier


def bubble_fraction(p: int, m: int, schedule: str = "1f1b", v: int = 1) -> float:
    """Fraction of the step spent idle in the bubble (GPipe/1F1B: (p-1)/(m+p-1))."""
    b = SCHEDULES[schedule].bubble(p, v) if p > 1 else 0.0
    return b / (m + b) if m + b else 0.0


@dataclass
class AxisReport:
    name: str
    size: int
    collective: str
    calls_per_step: float
    bytes_per_step: float  # per GPU
    hideable: bool
    tier: str = ""
    gbps: float = 0.0
    latency_us: float = 0.0
    seconds: float = 0.0  # the traffic's time on its tier
    exposed_s: float = 0.0  # what the step pays
    hidden_s: float = 0.0
    bytes_per_microbatch: float = 0.0
    straddling_groups: int = 0  # groups that span more than one node
    groups: int = 0

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class Step:
    compute: float
    tp: float
    cp: float
    ep: float
    pp_bubble: float
    p2p: float
    dp_exposed: float
    total_s: float
    wall_s: float
    stage: int  # the slowest stage
    microbatch_s: float  # one micro-batch on it (compute + exposed collectives)
    compute_microbatch_s: float

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class Traffic:
    """Tier-independent figures per micro-batch for one stage."""

    compute_s: float
    tp: tuple[float, float]  # (calls, bytes per call)
    cp: tuple[float, float]
    ep: tuple[float, float]


def stage_traffic(st: Stage, d: Layout, mm: ModelMath, tr, hw) -> Traffic:
    t, c = d.tp, d.cp
    s, b = tr.seq_len, tr.micro_batch
    tokens = s / c * b
    full = tr.recompute == "full"
    compute = st.hw_flops_tok * tokens / t / (hw.peak_tflops * 1e12)
    n = len(st.layers)
    if not tr.flash_attention:
        # Without flash attention the score matrix goes through HBM, in bytes per element:
        # forward: QK^T writes 2, fused scale-mask-softmax reads and writes 4, dropout 5
        # (read, write, 1-byte mask), AV reads 2; backward about 17; a recompute repeats
        # the forward. Memory-bound, so it costs bytes / HBM bandwidth, not FLOPs.
        fwd = 8 + (5 if mm.dropout else 0)
        per_element = fwd + (fwd + 4) + (fwd if full else 0)
        score_bytes = n * mm.heads / min(t, mm.heads) * tokens * s * per_element
        compute += score_bytes / (hw.hbm_gbps * 1e9)
    tp = (n * (6 if full else 4), 2 * (t - 1) / t * tokens * mm.h * 2) if t > 1 else (0.0, 0.0)
    if c > 1:
        if mm.mla:
            kv_width = mm.mla.kv_lora_rank + mm.mla.qk_rope_head_dim  # gather the latent
        else:
            kv_width = 2 * mm.hd * max(mm.kv // t, 1)
        cp = (n * (3 if full else 2), (c - 1) / c * s * b * kv_width * 2)
    else:
        cp = (0.0, 0.0)
    if d.ep > 1 and st.moe_layers:
        k = mm.moe.experts_per_token
        ep = (st.moe_layers * (6 if full else 4), (d.ep - 1) / d.ep * tokens * k * mm.h * 2 / t)
    else:
        ep = (0.0, 0.0)
    return Traffic(compute, tp, cp, ep)


def _time(calls: float, nbytes: float, tier: Tier) -> float:
    return calls * (nbytes / (tier.gbps * 1e9) + tier.latency_us * 1e-6) if calls else 0.0


def axis_traffic(stages: list[Stage], d: Layout, mm: ModelMath, tr, hw, sp: bool) -> dict[str, AxisReport]:
    """Calls and bytes per step per GPU for every axis (no tiers yet: the order needs these)."""
    m, p, n = d.microbatches, d.pp, d.chunks
    traffic = [stage_traffic(st, d, mm, tr, hw) for st in stages]
    j = max(range(len(stages)), key=lambda i: traffic[i].compute_s)
    tj = traffic[j]
    out: dict[str, AxisReport] = {}
    for name, (calls, nbytes), size in (("tp", tj.tp, d.tp), ("cp", tj.cp, d.cp), ("ep", tj.ep, d.ep)):
        out[name] = AxisReport(name, size, AXES[name].collective, m * calls, m * calls * nbytes, hideable=False,
                               bytes_per_microbatch=calls * nbytes)
    s_tokens = tr.seq_len / d.cp * tr.micro_batch
    send = s_tokens * mm.h * 2 / (d.tp if sp else 1)
    sends = 2 * m * n if p > 1 else 0
    out["pp"] = AxisReport("pp", p, AXES["pp"].collective, sends, sends * send, hideable=True,
                           bytes_per_microbatch=2 * n * send if p > 1 else 0)
    st = stages[j]
    # AR = RS + AG; FSDP (ZeRO-3) gathers the weights again for backward
    rounds = 3.0 if d.zero == 3 else 2.0
    units = max(len(st.layers), 1)
    collective = AXES["dp"].collective if d.zero else "all-reduce"
    for name, size, group, copies, weights in (
            ("dp", d.dp, d.dp_shard * d.cp, d.dp_replicate, (st.params - st.expert_params) / d.tp),
            ("edp", d.edp, d.edp, 1, st.expert_params / (d.etp * d.ep))):
        live = group * copies > 1 and weights > 0
        nbytes = rounds * 2.0 * weights * (group - 1) / group
        # HSDP: the shards' gradients are all-reduced across the copies of the state too
        nbytes += 2.0 * 2.0 * weights / group * (copies - 1) / copies
        out[name] = AxisReport(name, size, collective, ((rounds if d.zero else 1) + (copies > 1)) * units
                               if live else 0, nbytes if live else 0, hideable=True)
    return out


def auto_order(axes: dict[str, AxisReport], d: Layout) -> list[str]:
    """Busiest collectives innermost: traffic that cannot hide before traffic that can,
    then by how often it fires, then by bytes (seed 1's matching of collectives to links)."""
    live = [a for a in axes.values() if a.name in CANONICAL_ORDER and a.size > 1 and a.calls_per_step > 0]
    live.sort(key=lambda a: (a.hideable, -a.calls_per_step, -a.bytes_per_step))
    ranked = iter(a.name for a in live)
    names = {a.name for a in live}
    # Size-1 axes do not move any rank; they keep their canonical (Meta) positions and the
    # live axes fill the other positions in ranked order.
    order = [next(ranked) if a in names else a for a in CANONICAL_ORDER]
    if expert_needs_pp_last(d):
        order = [a for a in order if a != "pp"] + ["pp"]
    return order


def expert_needs_pp_last(d: Layout) -> bool:
    """Experts that fold data parallelism in need pipeline parallelism outermost, or an
    expert group would span pipeline stages (Megatron-Core, initialize_model_parallel:
    the order ends with pp, or pp == 1, or the expert and dense data-parallel sizes agree)."""
    return d.ep > 1 and d.pp > 1 and d.edp != d.dp


def step_time(stages: list[Stage], d: Layout, mm: ModelMath, tr, hw,
              axes: dict[str, AxisReport], tiers: dict[str, Tier]) -> Step:
    m = d.microbatches
    per_mb = []
    for st in stages:
        tt = stage_traffic(st, d, mm, tr, hw)
        tp = _time(*tt.tp, tiers["tp"])
        cp = _time(*tt.cp, tiers["cp"])
        ep = _time(*tt.ep, tiers["ep"])
        ep_hidden = 0.0
        if d.schedule.overlaps_ep:
            # DualPipe overlaps one micro-batch's all-to-all with another's computation.
            ep_hidden = min(ep, tt.compute_s)
            ep -= ep_hidden
        per_mb.append((tt.compute_s + tp + cp + ep, tt.compute_s, tp, cp, ep, ep_hidden))
    j = max(range(len(stages)), key=lambda i: per_mb[i][0])
    mb, comp, tp, cp, ep, ep_hidden = per_mb[j]
    axes["ep"].hidden_s = m * ep_hidden
    bubble = (d.schedule.bubble(d.pp, d.vp) if d.pp > 1 else 0.0) * mb
    pp = axes["pp"]
    p2p = 0.0
    if d.pp > 1:
        send_bytes = pp.bytes_per_microbatch / (2 * d.chunks)
        one = send_bytes / (tiers["pp"].gbps * 1e9) + tiers["pp"].latency_us * 1e-6
        pp.seconds = pp.calls_per_step * one
        p2p = 2 * (d.pp * d.chunks - 1) * one
        pp.exposed_s, pp.hidden_s = p2p, max(pp.seconds - p2p, 0.0)
    dp_exposed = _data_parallel(axes, tiers, d, window=2.0 / 3.0 * m * comp)
    for name, t in (("tp", tp), ("cp", cp), ("ep", ep)):
        axes[name].exposed_s = m * t
        axes[name].seconds = m * t + axes[name].hidden_s
    total = m * mb + bubble + p2p + dp_exposed
    return Step(compute=m * comp, tp=m * tp, cp=m * cp, ep=m * ep, pp_bubble=bubble, p2p=p2p,
                dp_exposed=dp_exposed, total_s=total, wall_s=total / hw.kernel_efficiency, stage=j,
                microbatch_s=mb, compute_microbatch_s=comp)


def _data_parallel(axes: dict[str, AxisReport], tiers: dict[str, Tier], d: Layout, window: float) -> float:
    """Dense and expert gradient traffic share the backward as their hiding window; the
    first weight gather of a step (ZeRO/FSDP) cannot hide."""
    live = [axes[n] for n in ("dp", "edp") if axes[n].calls_per_step]
    for a in live:
        tier = tiers[a.name]
        a.seconds = a.bytes_per_step / (tier.gbps * 1e9) + a.calls_per_step * tier.latency_us * 1e-6
    busy = sum(a.seconds for a in live)
    first_gather = sum(a.seconds / a.calls_per_step for a in live) if d.zero else 0.0
    exposed = max(busy - window, 0.0) + first_gather
    for a in live:  # each axis carries its share of what sticks out
        a.exposed_s = exposed * a.seconds / busy if busy else 0.0
        a.hidden_s = max(a.seconds - a.exposed_s, 0.0)
    return exposed
