"""Step-time model: arithmetic, TP collectives, a bubble of (p-1)/m (GPipe, Huang et al. 2019,
arXiv:1811.06965, section 2.3; Narayanan et al. 2021, arXiv:2104.04473, section 2.2.1), point-to-point
sends between stages, data-parallel traffic hidden behind compute except what sticks out,
read as the software stack (`stack`) runs it, on the network the fabric (`fabric`) builds.
Each axis is costed on the tier its groups actually span, so a bad rank order shows up as
a slower step.

Per micro-batch on the slowest stage (the pipeline runs at its pace):
- compute: at peak for the roofline budget (`total_s`, the worked example's figures:
  tests/test_seed_examples.py); at the kernels'
  speed for the predicted step (`wall_s`): the shape-aware kernel model (plan/kernels.py,
  cost.kernel_model=shape) or one kernel efficiency (cost.kernel_model=constant: the
  planner's first model, wall = total / hardware.kernel_efficiency)
- TP: 4 collectives per layer (2 forward, 2 backward; 6 with full recompute, 5 with torchtitan's
  op-level selective AC, which runs the all-gathers again, not the reduce-scatters; half with a
  parallel block), each moving 2(t-1)/t x (s/cp) b h x 2 bytes (all-reduce, or AG + RS with
  SP); `stack.tp_overlap` of it hides behind the GEMMs (Transformer Engine, async TP)
- CP (Llama 3's all-gather CP): K and V all-gathered forward, reduce-scattered backward,
  (c-1)/c x s b x KV width x 2 bytes each
- EP: all-to-all dispatch and combine, forward and backward, of the routed copies that
  leave the GPU, split into the copies that stay in the NVLink domain and those that cross
  the network (node-limited routing sends a token once per remote node, DeepSeek-V3);
  the two run side by side. FP8 runs dispatch in FP8. DualPipe (schedule.overlaps_ep)
  hides it behind the other micro-batch's compute; Megatron-Core's combined 1F1B
  (`stack.ep_overlap`) hides each all-to-all behind the one module of the other micro-batch
  beside it, layer by layer (_combined_layers_s), but for the micro-batches that run alone
  (_alone_share).
Per step: m x the above; the bubble is the schedule's (config/schedules.py) in
micro-batches of the slowest stage; P2P = the sends on the critical path of fill and
drain, 2 (p x chunks - 1); DP = weight all-gathers and gradient reduce-scatters (or an
all-reduce without sharding) once per step, dense weights over dp x cp, experts over edp,
gradients in `stack.grad_reduce_bytes` (or grad_bytes) per element, hidden as the stack
hides them (`stack.dp_window`):
- `step`: behind dp_overlap x the step's compute, the step's first gather exposed
  (this runtime's first model);
- `microbatch`: gradients are final only in the last micro-batch, so their reduction
  hides behind its backward and the weight gather behind the next step's first forward,
  model chunk by chunk when interleaved (Megatron-Core, FSDP with gradient accumulation).
A ring crossing an oversubscribed tier is slowed only when a block's groups send more
streams out of it than its uplinks carry (a ring has one edge out per group per block).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from orchestrator.config.schedules import SCHEDULES
from orchestrator.plan.axes import AXES, CANONICAL_ORDER
from orchestrator.plan.kernels import coefficients, moe_modules, shape_of, stage_features, step_features
from orchestrator.plan.layout import Layout
from orchestrator.plan.validate import check_order
from orchestrator.plan.model import OP_SAC, ModelMath
from orchestrator.plan.overheads import HostCalls, host_calls
from orchestrator.plan.stages import Stage, reduce_grad_bytes
from orchestrator.plan.topology import Tier, tiers_for


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
    total_s: float  # the roofline budget: arithmetic at peak, the parts above sum to it
    wall_s: float  # the predicted wall-clock step
    stage: int  # the slowest stage
    microbatch_s: float  # one micro-batch on it (compute + exposed collectives), roofline
    compute_microbatch_s: float  # its arithmetic at peak
    kernel_efficiency: float = 0.0  # arithmetic at peak / arithmetic at the kernels' speed
    # The same parts at the kernels' speed (what the predicted step pays); they sum to wall_s.
    wall_compute: float = 0.0
    wall_tp: float = 0.0
    wall_cp: float = 0.0
    wall_ep: float = 0.0
    wall_pp_bubble: float = 0.0
    wall_p2p: float = 0.0
    wall_dp_exposed: float = 0.0
    # hardware=cpu: how many times as long each rank's work takes, its processes sharing the host's
    # cores (_core_share); 1 where every rank has a core of its own (every GPU)
    core_share: float = 1.0

    @property
    def wall(self) -> dict:
        return {k: getattr(self, "wall_" + k) for k in WALL_PARTS}

    def to_json(self) -> dict:
        return asdict(self)


WALL_PARTS = ("compute", "tp", "cp", "ep", "pp_bubble", "p2p", "dp_exposed")


@dataclass(frozen=True)
class AxisCost:
    """What the predicted step pays on one axis: its traffic's time on its tier, the part the
    step waits for and the part hidden behind compute; for TP, CP and EP also the traffic of
    the stage that sets the pace (calls, bytes per step, bytes per micro-batch), which replaces
    the compute-slowest stage's that ranked the axes before the tiers were known."""

    seconds: float = 0.0
    exposed_s: float = 0.0
    hidden_s: float = 0.0
    paced: tuple[float, float, float] | None = None

    def report(self, a: AxisReport) -> AxisReport:
        """The axis' report: its traffic and tier (`a`, from the shape) with these costs."""
        traffic = {}
        if self.paced is not None:
            traffic = dict(zip(("calls_per_step", "bytes_per_step", "bytes_per_microbatch"), self.paced))
        return replace(a, seconds=self.seconds, exposed_s=self.exposed_s, hidden_s=self.hidden_s, **traffic)


@dataclass(frozen=True)
class StepCost:
    """What step_time computes: the step's parts and, per axis it costs, what that axis pays."""

    step: Step
    axes: dict[str, AxisCost]

    def reports(self, axes: dict[str, AxisReport]) -> dict[str, AxisReport]:
        """The axes' reports with their costs (an axis the step does not cost keeps its own)."""
        return {k: self.axes[k].report(a) if k in self.axes else a for k, a in axes.items()}


@dataclass
class Traffic:
    """Tier-independent figures per micro-batch for one stage."""

    compute_s: float
    tp: tuple[float, float]  # (calls, bytes per call)
    cp: tuple[float, float]
    ep: tuple[float, float]


def _stack(spec):
    return spec.stack if spec is not None else None


def stage_traffic(st: Stage, d: Layout, mm: ModelMath, tr, hw, spec=None) -> Traffic:
    t, c = d.tp, d.cp
    s, b = tr.seq_len, tr.micro_batch
    tokens = s / c * b
    frac = getattr(st, "recompute_frac", 1.0 if tr.recompute == "full" else 0.0)
    full = frac > 0
    compute = st.hw_flops_tok * tokens / t / (hw.peak_tflops * 1e12)
    n = len(st.layers) + getattr(st, "mtp", 0)
    if not tr.flash_attention:
        # Without flash attention the score matrix goes through HBM, in bytes per element:
        # forward: QK^T writes 2, fused scale-mask-softmax reads and writes 4, dropout 5
        # (read, write, 1-byte mask), AV reads 2; backward about 17; a recompute repeats
        # the forward. Memory-bound, so it costs bytes / HBM bandwidth, not FLOPs.
        # Selective recompute (either definition) re-runs the attention core, and so its forward.
        fwd = 8 + (5 if mm.dropout else 0)
        per_element = fwd + (fwd + 4) + (fwd * frac if full else fwd if tr.recompute == "selective" else 0)
        score_bytes = n * mm.heads / min(t, mm.heads) * tokens * s * per_element
        compute += score_bytes / (hw.hbm_gbps * 1e9)
    stack = _stack(spec)
    per_layer = 4 + 2 * frac
    if tr.recompute == "selective" and stack is not None and stack.selective.value in OP_SAC:
        per_layer += 1  # the SP all-gathers run again (the reduce-scatters are saved): half a forward's two
    if stack is not None and stack.parallel_block:
        per_layer /= 2  # attention and MLP side by side: one collective per block and direction
    act = activation_bytes(tr)
    tp = (n * per_layer, 2 * (t - 1) / t * tokens * mm.h * act) if t > 1 else (0.0, 0.0)
    if c > 1:
        if mm.mla:
            kv_width = mm.mla.kv_lora_rank + mm.mla.qk_rope_head_dim  # gather the latent
        else:
            kv_width = 2 * mm.hd * max(mm.kv // t, 1)
        cp = _cp_traffic(stack.cp_comm.value if stack is not None else "all_gather", n, frac, c, s * b, t,
                         kv_width, mm, act)
    else:
        cp = (0.0, 0.0)
    if d.ep > 1 and st.moe_layers:
        k = mm.moe.experts_per_token
        # Dispatch in FP8 on FP8 runs (DeepSeek-V3, Sec. 3.3), combine and backward in bf16.
        nbytes = 1.75 if tr.precision == "fp8" else act
        ep = (st.moe_layers * (4 + 2 * frac), (d.ep - 1) / d.ep * tokens * k * mm.h * nbytes / t)
    else:
        ep = (0.0, 0.0)
    return Traffic(compute, tp, cp, ep)


CP_COLLECTIVE = {"p2p": "ring send/recv K,V (dK,dV)", "a2a": "all-to-all Q,K,V / O"}


def _cp_traffic(kind: str, n: int, frac: float, c: int, tokens: float, t: int, kv_width: float, mm: ModelMath,
                act: float) -> tuple[float, float]:
    """(calls, bytes per call) of context parallelism per micro-batch, as the stack runs it
    (stack.cp_comm): `all_gather` (Llama 3, torch's CP with allgather rotation, this runtime):
    K and V all-gathered forward, reduce-scattered backward; `p2p` (Megatron-Core /
    Transformer Engine's default cp_comm_type, ring attention): c - 1 sends of a rank's K/V
    block forward, K/V and their gradients backward, each hidden behind a block's attention
    (step_time); `a2a` (DeepSpeed-Ulysses, Megatron's a2a): Q, K, V to head shards and O
    back, forward and backward, none hidden."""
    block = tokens / c  # one rank's share of the sequence
    if kind == "p2p":
        return n * (c - 1) * (3 + frac), block * kv_width * act
    if kind == "a2a":
        q = mm.heads * mm.hd / t
        return n * 2 * (2 + frac), (c - 1) / c * block * (2 * q + kv_width) / 2 * act
    return n * (2 + frac), (c - 1) / c * tokens * kv_width * act


def activation_bytes(tr) -> float:
    """Bytes of an activation element on the wire: 2 in bf16 (and FP8 runs' bf16 parts), 4 in fp32."""
    return 4.0 if tr.precision.value == "fp32" else 2.0


def _time(calls: float, nbytes: float, tier: Tier) -> float:
    return calls * (nbytes / (tier.gbps * 1e9) + tier.latency_us * 1e-6) if calls else 0.0


def _grad_bytes(spec) -> float:
    return reduce_grad_bytes(spec.stack if spec is not None else None)


def axis_traffic(stages: list[Stage], d: Layout, mm: ModelMath, tr, hw, sp: bool, spec=None) -> dict[str, AxisReport]:
    """Calls and bytes per step per GPU for every axis (no tiers yet: the order needs these)."""
    m, p, n = d.microbatches, d.pp, d.chunks
    traffic = [stage_traffic(st, d, mm, tr, hw, spec) for st in stages]
    j = max(range(len(stages)), key=lambda i: traffic[i].compute_s)
    tj = traffic[j]
    out: dict[str, AxisReport] = {}
    cp_kind = spec.stack.cp_comm.value if spec is not None else "all_gather"
    for name, (calls, nbytes), size in (("tp", tj.tp, d.tp), ("cp", tj.cp, d.cp), ("ep", tj.ep, d.ep)):
        collective = CP_COLLECTIVE.get(cp_kind, AXES[name].collective) if name == "cp" else AXES[name].collective
        # the ring (p2p) sends each K/V block behind the attention of the one before (step_time)
        hides = name == "cp" and cp_kind == "p2p" and bool(tr.flash_attention)
        out[name] = AxisReport(name, size, collective, m * calls, m * calls * nbytes, hideable=hides,
                               bytes_per_microbatch=calls * nbytes)
    s_tokens = tr.seq_len / d.cp * tr.micro_batch
    send = s_tokens * mm.h * activation_bytes(tr) / (d.tp if sp else 1)
    sends = 2 * m * n if p > 1 else 0
    out["pp"] = AxisReport("pp", p, AXES["pp"].collective, sends, sends * send, hideable=True,
                           bytes_per_microbatch=2 * n * send if p > 1 else 0)
    st = stages[j]
    gb = _grad_bytes(spec)
    units = max(len(st.layers), 1)
    collective = AXES["dp"].collective if d.zero else "all-reduce"
    for name, size, group, copies, weights in (
            ("dp", d.dp, d.dp_shard * d.cp, d.dp_replicate, (st.params - st.expert_params) / d.tp),
            ("edp", d.edp, d.edp, 1, st.expert_params / (d.etp * d.ep))):
        live = group * copies > 1 and weights > 0
        r, g = _dp_rounds(d.zero, weights, group, gb)
        nbytes = r + g
        # HSDP: the shards' gradients are all-reduced across the copies of the state too
        nbytes += 2.0 * gb * weights / group * (copies - 1) / copies
        # ZeRO-3: two weight gathers (forward, backward) of zero3_gathers_per_layer calls each
        gathers = 2.0 * spec.stack.zero3_gathers_per_layer if spec is not None else 2.0
        rounds = (1.0 + gathers if d.zero == 3 else 2.0) if d.zero else 1.0
        calls = (rounds + (copies > 1)) * _dp_units(spec, d.zero, weights, group, units)
        out[name] = AxisReport(name, size, collective, calls if live else 0, nbytes if live else 0, hideable=True)
    return out


def _dp_units(spec, zero: int, weights: float, group: int, layers: int) -> float:
    """Collectives per round: one per layer (FSDP's units, ZeRO-3), or one per gradient bucket
    where the stack buckets (stack.dp_bucket_params: Megatron-Core's DDP uses buckets of
    max(40M, 1M x dp) parameters, megatron/core/distributed/distributed_data_parallel.py, so
    that calls stay few at scale; DeepSpeed's reduce_bucket_size is 5e8 elements)."""
    bucket = spec.stack.dp_bucket_params if spec is not None else 0.0
    if bucket <= 0 or zero == 3:  # ZeRO-3 gathers each layer's weights when that layer runs
        return float(max(layers, 1))
    return float(max(1, math.ceil(weights / max(bucket, 1e6 * group))))


def _dp_rounds(zero: int, weights: float, group: int, gb: float) -> tuple[float, float]:
    """(gradient bytes, weight bytes) per GPU per step of one data-parallel group: an
    all-reduce without sharding (ZeRO-0), reduce-scatter + all-gather (1, 2), and one more
    all-gather for backward when the weights are sharded too (3)."""
    share = weights * (group - 1) / group
    if not zero:
        return 2.0 * gb * share, 0.0
    return gb * share, (2.0 if zero == 3 else 1.0) * 2.0 * share


def auto_order(axes: dict[str, AxisReport], d: Layout) -> list[str]:
    """Busiest collectives innermost: traffic that cannot hide before traffic that can,
    then by how often it fires, then by bytes (the matching of collectives to links of Llama 3,
    arXiv:2407.21783, section 3.3.2)."""
    live = [a for a in axes.values() if a.name in CANONICAL_ORDER and a.size > 1 and a.calls_per_step > 0]
    live.sort(key=lambda a: (a.hideable, -a.calls_per_step, -a.bytes_per_step))
    ranked = iter(a.name for a in live)
    names = {a.name for a in live}
    # Size-1 axes do not move any rank; they keep their canonical (Meta) positions and the
    # live axes fill the other positions in ranked order.
    order = [next(ranked) if a in names else a for a in CANONICAL_ORDER]
    if check_order(d, order):  # the two grids would disagree on pipeline groups (or Megatron's rule)
        order = [a for a in order if a != "pp"] + ["pp"]
    return order


# ---- tiers seen by one group ---------------------------------------------------------------------

def _members_per_block(d: Layout, order: list[str] | None, name: str, block: int) -> int:
    """Members of one group of this axis inside one block of `block` consecutive ranks."""
    if order is None:
        return 1
    axis = AXES[name]
    grid = d.dense_grid(order) if axis.grid == "dense" else d.expert_grid(order)
    k = 1
    for a in axis.members:
        size, stride = grid.sizes.get(a, 1), grid.strides.get(a, 1)
        k *= max(1, min(size, block // stride)) if size > 1 else 1
    return k


def _oversubscribed(spec) -> dict[str, tuple[float, int]]:
    """Tier name -> (oversubscription, size of the blocks it connects), as tiers_for lists them."""
    if spec is None:
        return {}
    hw, fabric = spec.hardware, spec.fabric
    out, below = {}, fabric.nvlink_domain or hw.gpus_per_node
    for t in sorted(fabric.tiers or hw.tiers, key=lambda t: t.size):
        out[t.name] = (max(float(t.oversubscription), 1.0), below)
        below = t.size
    return out


def _dp_gbps(tier: Tier, nvlink: Tier, d: Layout, order, name: str, over: dict) -> float:
    """Per-GPU bandwidth of a data-parallel collective on its tier. NCCL runs it
    hierarchically (one ring per NIC): with k members of a group in one NVLink domain only
    1/k of the data leaves each GPU, so the group gets up to k x the per-GPU network
    bandwidth (at most NVLink's). On an oversubscribed tier a ring sends one stream out of a
    block per group, so a block holding k members of each group is slowed only when
    k < oversubscription."""
    if tier.name == nvlink.name:
        return tier.gbps
    k_node = _members_per_block(d, order, name, nvlink.size)
    return min(nvlink.gbps, _stream_gbps(tier, d, order, name, over) * k_node)


def _dp_latency_s(tier: Tier, nvlink: Tier, d: Layout, order, name: str) -> float:
    """Seconds of latency per data-parallel collective. A ring all-gather or reduce-scatter
    over n ranks takes n - 1 steps, each paying the link's latency (Thakur, Rabenseifner and
    Gropp 2005, "Optimization of collective communication operations in MPICH": (p - 1) alpha
    + (p - 1) / p n beta; NCCL runs AG/RS as rings): the steps between GPUs of one NVLink
    domain at its latency, those between domains at the network's. An all-reduce (ZeRO-0)
    runs as NCCL's double binary tree: 2 log2(domains) network steps. Each call pays one more
    network latency as its fixed cost. This is NCCL's own model (src/graph/tuning.cc,
    ncclTopoTuneModel: base + (nRanks - nNodes) x intra + (nNodes - 1) x inter; Simple
    protocol 3.4 us per NVLink step, 9.6 us per network step, 8.4 us base: the presets'
    3 and 10 us). Small per-layer messages over a thousand GPUs are latency-bound
    (FSDP/ZeRO-3's per-layer gathers)."""
    n = d.dp_shard * d.cp if name == "dp" else d.edp
    if n <= 1:
        return 0.0
    if tier.name == nvlink.name:
        return n * tier.latency_us * 1e-6
    k = max(1, min(n, _members_per_block(d, order, name, nvlink.size)))
    domains = max(n // k, 1)
    if not d.zero:
        return (tier.latency_us * (1 + 2 * math.ceil(math.log2(domains))) + 2 * (k - 1) * nvlink.latency_us) * 1e-6
    return (domains * tier.latency_us + domains * (k - 1) * nvlink.latency_us) * 1e-6


def _stream_gbps(tier: Tier, d: Layout, order, name: str, over: dict) -> float:
    """Per-GPU bandwidth of a ring or a chain of sends over a tier: full link speed unless
    the tier is oversubscribed and a block sends more streams out than its uplinks carry."""
    factor, block = over.get(tier.name, (1.0, tier.size))
    if factor <= 1.0:
        return tier.gbps
    return min(tier.gbps * factor, tier.gbps * _members_per_block(d, order, name, block))


def _ep_time(calls: float, nbytes: float, tier: Tier, nvlink: Tier, d: Layout, order, spec) -> float:
    """All-to-all of the routed copies: the copies for GPUs in this NVLink domain go over
    NVLink, the others over the network, at the same time (node-limited routing: once per
    remote domain, then forwarded inside it)."""
    if not calls:
        return 0.0
    if tier.name == nvlink.name or spec is None:
        return _time(calls, nbytes, tier)
    ep = d.ep
    g = min(ep, _members_per_block(d, order, "ep", nvlink.size))  # EP peers in my domain
    if g >= ep:
        return _time(calls, nbytes, nvlink)
    remote = (ep - g) / ep  # fraction of a token's copies bound for other domains
    local = (g - 1) / ep
    per_copy = nbytes / max((ep - 1) / ep, 1e-12)  # bytes of all the token's copies
    k = max(spec.model.moe.experts_per_token, 1)
    limit = spec.model.moe.max_nodes_per_token
    net_copies = remote
    if limit and limit > 0:  # dedup: one copy per remote domain, at most `limit` domains
        domains = ep / g
        distinct = (domains - 1) * (1 - (1 - 1 / domains) ** k) if domains > 1 else 0.0
        net_copies = min(remote, min(limit, distinct) / k)
        local += remote - net_copies  # forwarded over NVLink inside the destination domain
    net = per_copy * net_copies / (tier.gbps * 1e9)
    nv = per_copy * local / (nvlink.gbps * 1e9)
    return calls * (max(net, nv) + tier.latency_us * 1e-6)


# ---- the step --------------------------------------------------------------------------------------

@dataclass
class _Pass:
    mb: float
    comp: float
    tp: float
    cp: float
    ep: float
    ep_hidden: float
    bubble: float
    dp: float
    stage: int


def step_time(stages: list[Stage], d: Layout, mm: ModelMath, axes: dict[str, AxisReport],
              tiers: dict[str, Tier], order: list[str], spec) -> StepCost:
    """The step of `stages` laid out as `d` on `tiers` (the shape's traffic per axis in
    `axes`, read, never written), under `spec`'s training, hardware, stack and coefficients."""
    tr, hw, stack = spec.training, spec.hardware, spec.stack
    m = d.microbatches
    traffic = [stage_traffic(st, d, mm, tr, hw, spec) for st in stages]
    nvlink = tiers_for(spec)[0]
    tp_hide = stack.tp_overlap
    combined = _combined_shares(stages, d, mm, tr, hw, spec)  # per stage, or None: no combined 1F1B
    delay_wgrad = stack.ep_overlap.value == "combined_1f1b_delay_wgrad"
    over = _oversubscribed(spec)
    cp_tier = replace(tiers["cp"], gbps=_stream_gbps(tiers["cp"], d, order, "cp", over))
    pp_tier = replace(tiers["pp"], gbps=_stream_gbps(tiers["pp"], d, order, "pp", over))
    comm = []
    ring = _ring_attention_s(stages, d, mm, tr, hw, spec)
    for i, tt in enumerate(traffic):
        tp = _time(*tt.tp, tiers["tp"]) * (1.0 - tp_hide)
        cp = _time(*tt.cp, cp_tier)
        cp = max(cp - ring[i], min(cp, _time(tt.cp[0], 0.0, cp_tier))) if ring[i] else cp  # latency stays
        ep = _ep_time(*tt.ep, tiers["ep"], nvlink, d, order, spec)
        comm.append((tp, cp, ep))

    # hierarchical, ring-aware bandwidth of the data-parallel axes
    dp_gbps = {n: (_dp_gbps(tiers[n], nvlink, d, order, n, over), _dp_latency_s(tiers[n], nvlink, d, order, n))
               for n in ("dp", "edp")}

    bidirectional = d.schedule.weight_copies == 2 and d.schedule.chunks(d.vp) == 1  # DualPipe
    sm = stack.ep_comm_sm_fraction  # validate.LIMITS: 0 .. 0.9

    def run(compute: list[float], comm=comm) -> _Pass:
        per = []
        for i, (c, (tp, cp, ep)) in enumerate(zip(compute, comm)):
            ep_hidden = 0.0
            alone = c + tp + cp + ep  # a micro-batch with its all-to-all exposed (the bubble's pace)
            if d.schedule.overlaps_ep:
                # DualPipe overlaps one micro-batch's all-to-all with another's computation.
                ep_hidden = min(ep, c)
            elif combined is not None and ep > 0 and stages[i].moe_layers:
                # Megatron-Core's combined 1F1B: paired micro-batches hide what their modules can, the
                # ones that run alone nothing.
                attn, experts, n, chunk, layers = combined[i]
                beside = (tp + cp) / layers
                per_chunk = _combined_layers_s(chunk, ep / (4 * n), tuple(x * c for x in attn),
                                               tuple(x * c for x in experts), beside, delay_wgrad)
                work = chunk * ((sum(attn) + sum(experts)) * c + beside)
                paired = min(max(per_chunk - work, 0.0) * n / chunk, ep)  # exposed when paired
                u = _alone_share(d, stages[i].index)
                ep_hidden = ep - (u * ep + (1.0 - u) * paired)
            # The SMs the hidden all-to-all runs on are missing from the compute meanwhile.
            c = c + ep_hidden * sm / (1.0 - sm)
            per.append((c + tp + cp + ep - ep_hidden, c, tp, cp, ep - ep_hidden, ep_hidden, alone))
        if bidirectional and len(per) > 1:
            # DualPipe feeds micro-batches from both ends: rank r runs stage r for one direction
            # and stage pp-1-r for the other (its second copy of the weights), so a rank's pace is
            # the mean of the two, and the heavy last stage (output head, MTP) is shared with the first.
            n = len(per)
            per = [tuple((a + b) / 2 for a, b in zip(per[r], per[n - 1 - r])) for r in range(n)]
        j = max(range(len(per)), key=lambda i: per[i][0])
        mb, comp, tp, cp, ep, ep_hidden, alone = per[j]
        # the fill and drain run micro-batches alone: at their pace under the combined 1F1B
        bubble = (d.schedule.bubble(d.pp, d.vp) if d.pp > 1 else 0.0) * (alone if combined is not None else mb)
        dp, _ = _data_parallel(axes, d, comp, m, spec, dp_gbps)
        return _Pass(mb, comp, tp, cp, ep, ep_hidden, bubble, dp, j)

    roof = run([tt.compute_s for tt in traffic])
    p2p = 0.0
    costs: dict[str, AxisCost] = {}
    pp = axes["pp"]
    if d.pp > 1:
        send_bytes = pp.bytes_per_microbatch / (2 * d.chunks)
        one = send_bytes / (pp_tier.gbps * 1e9) + pp_tier.latency_us * 1e-6
        p2p = 2 * (d.pp * d.chunks - 1) * one
        costs["pp"] = AxisCost(pp.calls_per_step * one, p2p, max(pp.calls_per_step * one - p2p, 0.0))
    total = m * roof.mb + roof.bubble + p2p + roof.dp

    constant = (spec.cost.kernel_model or spec.hardware.kernel_model).value == "constant"
    share = 1.0
    hj = HostCalls()  # host time per collective call (CPU presets the probe measured; plan/overheads.py)
    if constant:
        eff = hw.kernel_efficiency
        wall_s = total / eff
        ach, keff = roof, eff
        wall = {k: v / eff for k, v in (("compute", m * roof.comp), ("tp", m * roof.tp), ("cp", m * roof.cp),
                                         ("ep", m * roof.ep), ("pp_bubble", roof.bubble), ("p2p", p2p),
                                         ("dp_exposed", roof.dp))}
    else:
        coef = coefficients(hw, spec.cost)
        shape = shape_of(d, tr, hw, spec, coef)
        feats = [stage_features(st, mm, shape) for st in stages]
        kernel_s = [coef.seconds(f) + _scores_s(tt, st, mm, tr, hw, d) for f, st, tt in zip(feats, stages, traffic)]
        # the optimizer and the weights' copies, once a step (kernels.step_features; a CPU's are the probe's)
        clip = spec.clip_norm() > 0
        once = [0.0 if hw.device.value == "cpu" else coef.seconds(step_features(st, d, stack, shape.hbm, clip))
                for st in stages]
        if bidirectional and len(once) > 1:  # DualPipe's rank r also holds stage pp-1-r's weights and state
            once = [once[r] + once[len(once) - 1 - r] for r in range(len(once))]

        def priced(share: float):
            """The step with each rank's work (kernels and host calls) taking `share` times as long."""
            host = [host_calls(st, d, f.kernels * 1e6, hw, share, mm) for st, f in zip(stages, feats)]
            achieved = [k * share + h.compute_mb for k, h in zip(kernel_s, host)]
            ach = run(achieved, [(tp + h.tp_mb, cp + h.cp_mb, ep) for (tp, cp, ep), h in zip(comm, host)])
            hj = host[ach.stage]
            wall = {"compute": m * ach.comp + hj.optimizer_step + once[ach.stage], "tp": m * ach.tp, "cp": m * ach.cp,
                    "ep": m * ach.ep, "pp_bubble": ach.bubble, "p2p": p2p + hj.pp_step,
                    "dp_exposed": ach.dp + hj.dp_step}
            return ach, hj, host, wall

        share = _core_share(hw, d)
        ach, hj, host, wall = priced(share)
        wall_s = sum(wall.values())
        keff = traffic[ach.stage].compute_s / ach.comp if ach.comp > 0 else 0.0
    # The axes report what the predicted step pays.
    paced = _paced_traffic(traffic, ach.stage, bidirectional, m)
    tp_raw = _time(*traffic[ach.stage].tp, tiers["tp"]) + hj.tp_mb
    costs["tp"] = AxisCost(m * tp_raw, m * ach.tp, m * (tp_raw - ach.tp), paced["tp"])
    costs["cp"] = AxisCost(m * ach.cp, m * ach.cp, 0.0, paced["cp"])
    costs["ep"] = AxisCost(m * (ach.ep + ach.ep_hidden), m * ach.ep, m * ach.ep_hidden, paced["ep"])
    costs.update(_data_parallel(axes, d, ach.comp, m, spec, dp_gbps)[1])
    for name, extra in (("dp", hj.dp_step), ("pp", hj.pp_step)):  # FSDP2's and the sends' host time
        if extra:
            c = costs.get(name, AxisCost())
            costs[name] = replace(c, seconds=c.seconds + extra, exposed_s=c.exposed_s + extra)
    step = Step(compute=m * roof.comp, tp=m * roof.tp, cp=m * roof.cp, ep=m * roof.ep, pp_bubble=roof.bubble,
                p2p=p2p, dp_exposed=roof.dp, total_s=total, wall_s=wall_s, stage=roof.stage,
                microbatch_s=roof.mb, compute_microbatch_s=roof.comp, kernel_efficiency=keff, core_share=share,
                **{"wall_" + k: v for k, v in wall.items()})
    return StepCost(step, costs)


def _combined_shares(stages: list[Stage], d: Layout, mm: ModelMath, tr, hw, spec):
    """Per stage under Megatron-Core's combined 1F1B (stack.ep_overlap; None without it): one MoE layer's
    attention-side module and routed experts, (forward, dgrad, wgrad) each, as shares of the stage's
    compute (kernels.moe_modules), its MoE layers, the MoE layers of one model chunk (the combined step
    pairs a chunk's forward with a chunk's backward) and its layers (the TP/CP collectives' share)."""
    stack = _stack(spec)
    if stack is None or stack.ep_overlap.value == "none" or d.ep <= 1 or not mm.moe:
        return None
    coef = coefficients(hw, spec.cost)
    shape = shape_of(d, tr, hw, spec, coef)
    attn, experts = moe_modules(mm, shape, coef)
    out = []
    for st in stages:
        total = max(coef.seconds(stage_features(st, mm, shape)), 1e-30)
        n = max(st.moe_layers, 1)
        layers = max(len(st.layers) + getattr(st, "mtp", 0), 1)
        out.append((tuple(x / total for x in attn), tuple(x / total for x in experts), n,
                    max(1, round(n / d.chunks)), layers))
    return out


def _combined_layers_s(n: int, a2a: float, attn: tuple[float, float, float], experts: tuple[float, float, float],
                       beside: float, delay_wgrad: bool) -> float:
    """Seconds n MoE layers of one micro-batch's forward take beside n layers of another's backward in
    Megatron-Core's combined 1F1B (TransformerLayerSchedulePlan.run, model_chunk_schedule_plan.py, at
    NVIDIA/Megatron-LM@d98e8a6), each all-to-all `a2a` seconds, the modules' (forward, dgrad, wgrad) seconds
    `attn` and `experts`, `beside` seconds of TP/CP collectives per layer on the compute stream (half in
    the attention's forward, half in its backward). Per layer the nodes are issued in this order, the
    all-to-alls on the communication stream, the modules on the compute stream; each node waits for the
    last one of its own micro-batch (one CUDA event per micro-batch, ScheduleNode.stream_acquire_context)
    and for the one before it on its stream:
        combine bwd (b) | attention fwd (f) | experts dgrad (b) | dispatch fwd (f) | experts wgrad (b) |
        dispatch bwd (b) | experts fwd (f) | combine fwd (f) | attention dgrad (b) | attention wgrad (b)
    Without --delay-wgrad-compute a module's weight gradients run inside its backward node (the event
    waits for them); with it they run after, outside the event (TransformerLayerNode.backward_dw)."""
    af, ad, aw = attn[0] + beside / 2, attn[1] + beside / 2, attn[2]
    ef, ed, ew = experts
    if not delay_wgrad:
        ad, ed, aw, ew = ad + aw, ed + ew, 0.0, 0.0
    comm = comp = f = b = 0.0  # when each stream is free, when each micro-batch's last node ends
    for _ in range(n):
        comm = b = max(comm, b) + a2a  # combine backward
        comp = f = max(comp, f) + af  # attention forward
        comp = b = max(comp, b) + ed  # experts' input gradients
        comm = f = max(comm, f) + a2a  # dispatch forward
        comp += ew  # experts' weight gradients (delayed)
        comm = b = max(comm, b) + a2a  # dispatch backward
        comp = f = max(comp, f) + ef  # experts forward
        comm = f = max(comm, f) + a2a  # combine forward
        comp = b = max(comp, b) + ad  # attention's input gradients
        comp += aw  # attention's weight gradients (delayed)
    return max(comm, comp)


def _alone_share(d: Layout, rank: int) -> float:
    """The share of a pipeline rank's micro-batches whose forward and backward the combined 1F1B runs
    alone, their all-to-all exposed: without pipelining the first forward and the last backward
    (combined_1f1b_schedule_for_no_pipelining), interleaved each rank's warm-up forwards and cool-down
    backwards, 2 (pp - rank - 1) + (vp - 1) x pp + 1 model chunks of m x vp (schedules.py
    get_pp_rank_microbatches: one more than without the overlap; microbatch_group_size_per_vp_stage
    defaults to pp)."""
    m = max(d.microbatches, 1)
    if d.pp <= 1:
        return 1.0 / m
    total = m * d.chunks
    return min(2 * (d.pp - rank - 1) + (d.chunks - 1) * d.pp + 1, total) / total


def _ring_attention_s(stages: list[Stage], d: Layout, mm: ModelMath, tr, hw, spec) -> list[float]:
    """Per stage, the attention time of one micro-batch a ring (stack.cp_comm=p2p) hides its
    sends behind: (c - 1) / c of the attention core (the local block's is computed before the
    first block arrives), at the kernel model's attention speed; 0 for the other CP methods."""
    stack = _stack(spec)
    if d.cp <= 1 or stack is None or stack.cp_comm.value != "p2p" or not tr.flash_attention:
        return [0.0] * len(stages)
    coef = coefficients(hw, spec.cost)
    shape = shape_of(d, tr, hw, spec, coef)
    constant = (spec.cost.kernel_model or hw.kernel_model).value == "constant"
    speed = hw.kernel_efficiency if constant else coef.attention_efficiency
    return [stage_features(st, mm, shape).attn / speed * (d.cp - 1) / d.cp for st in stages]


def _core_share(hw, d: Layout) -> float:
    """How many times as long each rank's work takes where a hardware=cpu run's processes outnumber
    the host's cores (hardware.host_cores, the cores' worth the probe measured; 0 = one core per
    process; 1 on every GPU preset): world / cores, every rank counted as wanting a core all step.

    Not by CPU demand (a pipeline's rank idles in its bubble, which a work-conserving scheduler
    would give to the others: share = world x busy / (step x cores), solved consistently): measured
    on a quiet 2-core host (benchmarks/readme_cpu.py, 4 and 8 ranks, #37 item 6) that share
    under-predicts every pipeline layout more than this one (README's PP examples 1.19-1.38x
    measured/predicted against 1.03-1.20x; PP4 with 4 micro-batches 1.27-1.48x against 0.77-0.90x):
    the cores stand a third idle while the coupled ranks wait on each other's sends and collectives
    (/proc/stat during a TP2 x PP2 run), so the bubble's cores are not taken up."""
    cores = hw.host_cores or 0
    if hw.device.value != "cpu" or cores <= 0:
        return 1.0
    return max(1.0, d.world / cores)


def _paced_traffic(traffic: list[Traffic], stage: int, bidirectional: bool,
                   m: int) -> dict[str, tuple[float, float, float]]:
    """TP/CP/EP (calls, bytes per step, bytes per micro-batch) of the stage that sets the pace
    (whose seconds the axes report; DualPipe: the mean of a rank's two), not the
    compute-slowest stage's that ranked the axes for the order before the tiers were known."""
    paced = [traffic[stage]] + ([traffic[len(traffic) - 1 - stage]] if bidirectional and len(traffic) > 1 else [])
    out = {}
    for name in ("tp", "cp", "ep"):
        calls = sum(getattr(tt, name)[0] for tt in paced) / len(paced)
        per_mb = sum(getattr(tt, name)[0] * getattr(tt, name)[1] for tt in paced) / len(paced)
        out[name] = (m * calls, m * per_mb, per_mb)
    return out


def _scores_s(tt: Traffic, st: Stage, mm: ModelMath, tr, hw, d: Layout) -> float:
    """Without flash attention: the score matrix's HBM traffic (in stage_traffic's roofline
    compute too), costed at HBM speed beside the kernel model's work."""
    if tr.flash_attention:
        return 0.0
    at_peak = st.hw_flops_tok * tr.seq_len / d.cp * tr.micro_batch / d.tp / (hw.peak_tflops * 1e12)
    return max(tt.compute_s - at_peak, 0.0)


def _data_parallel(axes: dict[str, AxisReport], d: Layout, comp_mb: float, m: int, spec,
                   gbps: dict[str, tuple[float, float]]) -> tuple[float, dict[str, AxisCost]]:
    """What of the data-parallel traffic the step pays (see the module's docstring), and each
    data-parallel axis' cost: its traffic's time and its share of what sticks out."""
    live = [axes[n] for n in ("dp", "edp") if axes[n].calls_per_step]
    if not live:
        return 0.0, {}
    secs = {a.name: a.bytes_per_step / (gbps[a.name][0] * 1e9) + a.calls_per_step * gbps[a.name][1] for a in live}
    stack = spec.stack
    window_kind = stack.dp_window.value
    overlap = stack.dp_overlap
    first_exposed = bool(stack.dp_first_gather_exposed)
    busy = sum(secs.values())
    if window_kind == "step":
        first_gather = sum(secs[a.name] / a.calls_per_step for a in live) if d.zero and first_exposed else 0.0
        exposed = max(busy - overlap * m * comp_mb, 0.0) + first_gather
    else:
        exposed = _microbatch_window(live, secs, d, comp_mb, m, overlap, spec)
    costs = {}
    for a in live:
        share = exposed * secs[a.name] / busy if busy else 0.0
        costs[a.name] = AxisCost(secs[a.name], share, max(secs[a.name] - share, 0.0))
    return exposed, costs


def _microbatch_window(live, secs, d: Layout, comp_mb: float, m: int, overlap: float, spec) -> float:
    """Gradients reduce behind the last micro-batch's backward, weights gather behind the
    next step's first forward, chunk by chunk: chunk k of an interleaved rank finishes its
    last backward about k x pp chunk-backwards before the end, so only the first chunk's
    share must fit its own backward."""
    gb = _grad_bytes(spec)
    n, p = max(d.chunks, 1), max(d.pp, 1)
    exposed = 0.0
    for a in live:
        r, g = _dp_rounds(d.zero, 1.0, 2, gb)  # the split of this axis' bytes into grads and weights
        grad_s = secs[a.name] * r / (r + g)
        gather_s = secs[a.name] - grad_s
        tb = overlap * (2.0 / 3.0) * comp_mb / n  # one chunk's backward of one micro-batch
        tf = overlap * (1.0 / 3.0) * comp_mb / n
        reach = (n - 1) * p + 1
        exposed += max(grad_s / n - tb, grad_s - reach * tb, 0.0)
        if d.zero == 3:  # the weights are gathered for every micro-batch's forward and backward
            exposed += m * max(gather_s - overlap * comp_mb, 0.0) + gather_s / max(a.calls_per_step, 1)
        else:
            exposed += max(gather_s / n - tf, gather_s - reach * tf, 0.0)
    return exposed
