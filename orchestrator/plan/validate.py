"""Structural validation: values, degrees against the allocation, every divisibility rule.

Collects every problem (never stops at the first); each names the key(s), the numbers
and a fix. Memory and cross-node TP are judged later, once the byte inventory and the
cost model have numbers to quote (plan.py). `check_values` runs first and alone bounds
every number, so nothing later divides by zero, loops for ever or allocates a grid for
a typo.

As strict as the frameworks and no stricter: a rule that depends on the software stack
reads `stack.pipeline_rules` (torch: torch.distributed.pipelining and this runtime;
megatron: Megatron-Core) and cites, in a comment, the source it mirrors. Rules that hold
for every stack cite Megatron-Core's and torch's (or torchtitan's) version where both have
one. tests/test_megatron_rules.py checks the planner against Megatron's rules as Megatron
states them.
"""
from __future__ import annotations

import math
from typing import Any

from orchestrator.config.errors import Problem
from orchestrator.config.schedules import SCHEDULES
from orchestrator.config.schema import Config, PipelineAccounting
from orchestrator.plan.layout import Layout
from orchestrator.plan.topology import OrderError, parse_order

MAX_WORLD = 1 << 21  # 2M GPUs: ten times the largest cluster built; more is a typo, not a cluster
BIG = 1 << 24

# key: (lowest, highest) a physical configuration can have; outside is refused with the range.
LIMITS: dict[str, tuple[float, float]] = {
    "cluster.nodes": (1, 1 << 18), "hardware.gpus_per_node": (1, 1024), "hardware.gpu_memory_gb": (1e-3, 1e5),
    "hardware.peak_tflops": (1e-6, 1e6), "hardware.intra_node_gbps": (1e-3, 1e6),
    "hardware.inter_node_gbps": (1e-3, 1e6), "hardware.hbm_gbps": (1e-3, 1e6),
    "hardware.intra_node_latency_us": (0, 1e6), "hardware.inter_node_latency_us": (0, 1e6),
    "hardware.kernel_efficiency": (1e-3, 1.0), "hardware.reserve_gb": (0, 1e5),
    "hardware.failures_per_gpu_hour": (0, 1.0), "hardware.storage_gbps": (1e-3, 1e7),
    "model.layers": (1, 4096), "model.hidden": (1, 1 << 20), "model.ffn_hidden": (1, 1 << 22),
    "model.heads": (1, 1 << 16), "model.kv_heads": (1, 1 << 16), "model.vocab": (1, BIG),
    "model.head_dim": (1, 1 << 16), "model.norm_eps": (0, 1.0), "model.rope_theta": (1e-3, 1e12),
    "model.moe.experts": (0, 1 << 16), "model.moe.experts_per_token": (0, 1 << 16),
    "model.moe.expert_ffn_hidden": (0, 1 << 22), "model.moe.shared_experts": (0, 1024),
    "model.moe.dense_layers": (0, 4096), "model.mla.q_lora_rank": (0, 1 << 20),
    "model.mla.kv_lora_rank": (0, 1 << 20), "model.mla.qk_rope_head_dim": (0, 1 << 16),
    "model.mla.qk_nope_head_dim": (0, 1 << 16), "model.mla.v_head_dim": (0, 1 << 16),
    "training.seq_len": (1, BIG), "training.global_batch": (1, BIG), "training.micro_batch": (1, 1 << 16),
    "training.steps": (0, 1 << 40), "training.optimizer_bytes": (0, 64), "training.lr": (0, 100),
    "training.log_every": (1, 1 << 40), "training.adam_eps": (0, 1.0), "training.max_norm": (0, 1e30),
    "training.checkpoint.every": (0, 1 << 40),
    "training.checkpoint.snapshot_every": (0, 1 << 40),
    "training.checkpoint.keep": (1, 1 << 20), "layout.tp": (1, 1 << 16), "layout.cp": (1, 1 << 16),
    "layout.pp": (1, 4096), "layout.ep": (1, 1 << 16), "layout.etp": (1, 1 << 16), "layout.vp": (1, 1024),
    "layout.zero": (0, 3), "layout.dp_shard": (1, MAX_WORLD), "schedule.microbatches": (1, BIG),
    "search.top": (1, 1000), "cluster.spare_nodes": (0, 1 << 18), "stack.zero": (0, 3), "stack.grad_bytes": (0, 16),
    "stack.dp_overlap": (0, 1.0), "stack.tp_overlap": (0, 1.0),
    "fabric.nvlink_domain": (1, 1 << 16), "failover.timeout_s": (1, 86400), "failover.quorum_s": (0.1, 3600), "failover.lease_s": (1, 3600),
    "failover.collective_bound_s": (0.1, 86400),
    "failover.store_shards": (1, 4096),
    "hardware.gemm_efficiency": (1e-3, 1.0), "hardware.peak_fp8_tflops": (1e-6, 1e7),
    "hardware.peak_fp4_tflops": (1e-6, 1e7), "training.bf16_layers": (0, 4096),
    "hardware.flash2_speed": (1e-3, 1.0), "hardware.tdp_w": (1.0, 1e5), "hardware.power_cap_w": (1.0, 1e5), "stack.zero3_gathers_per_layer": (1.0, 64.0),
    "cost.elementwise": (0.0, 100.0), "cost.attention_efficiency": (1e-3, 1.0),
    "cost.fp8_gemm_efficiency": (1e-3, 1.0), "cost.launch_overhead_us": (0.0, 1e5),
    "model.moe.load_imbalance": (0.0, 100.0), "model.moe.max_nodes_per_token": (0, 1 << 16),
    "stack.ep_comm_sm_fraction": (0.0, 0.9), "stack.grad_reduce_bytes": (0.0, 16.0), "stack.dp_bucket_params": (0.0, 1e12),
    "training.recompute_layers": (0, 4096), "training.mtp_depth": (0, 16),
    "model.moe.route_scale": (1e-6, 1e6), "model.moe.bias_update_speed": (0.0, 1.0),
    "model.moe.aux_loss_coef": (0.0, 100.0),
    # measured host costs (orchestrate-calibrate --probe; 0 on GPU presets)
    "hardware.host_cores": (0.0, 1e5), "hardware.launch_overhead_us": (0.0, 1e5),
    **{f"hardware.{k}": (0.0, 1e7) for k in ("tp_call_us", "dtensor_op_us", "c10d_call_us", "fsdp_gather_us",
                                              "fsdp_reduce_us", "cp_call_us", "optimizer_us",
                                              "dtensor_optimizer_us", "pp_microbatch_us", "fsdp_gather_step_us",
                                              "fsdp_reduce_step_us")},
}


def _get(spec: Any, dotted: str) -> Any:
    obj = spec
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, min(n, 1 << 16) + 1) if n % d == 0]


def check_values(spec: Config) -> list[Problem]:
    """Every number inside its physical range (finite, positive where it must be)."""
    out = []
    for key, (lo, hi) in LIMITS.items():
        v = _get(spec, key)
        if v is None:  # optional keys (head_dim, etp, microbatches) left unset
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
            what = "must be positive" if lo > 0 and isinstance(v, (int, float)) and v <= 0 else "is out of range"
            out.append(Problem(key, f"{what}, got {v!r}; a real configuration has {lo:g} <= {key} <= {hi:g}.",
                               f"set {key} to a value in that range."))
    for key, tiers in (("hardware.tiers", spec.hardware.tiers), ("fabric.tiers", spec.fabric.tiers)):
        for i, t in enumerate(tiers):
            bad = _tier_fields(t)
            if bad:
                out.append(Problem(f"{key}[{i}]", f"tier {t.name!r} has {', '.join(bad)}; a tier needs size > 0, "
                                   "gbps > 0, oversubscription >= 1 and latency_us >= 0.",
                                   f"fix {bad[0].split('=')[0]} in {key}[{i}] ({key.split('.')[0]} preset, or "
                                   f"{key}=[...] on the command line)."))
    hw = spec.hardware
    if not out and hw.power_cap_w is not None and hw.tdp_w is None:
        out.append(Problem("hardware.power_cap_w", f"is {hw.power_cap_w:g} W but hardware={hw.name} states no TDP "
                           f"(hardware.tdp_w), so the cap's share of the board power is unknown.",
                           "set hardware.tdp_w to the GPU's board power from its datasheet (H100 SXM: 700)."))
    world = spec.cluster.nodes * spec.hardware.gpus_per_node
    if not out and world > MAX_WORLD:
        out.append(Problem("cluster.nodes, hardware.gpus_per_node",
                           f"{spec.cluster.nodes} nodes x {spec.hardware.gpus_per_node} GPUs = {world} GPUs, more "
                           f"than {MAX_WORLD}.", "check cluster.nodes; no cluster has that many GPUs."))
    dp = spec.layout.dp
    if not (dp == "auto" or (isinstance(dp, int) and not isinstance(dp, bool) and 0 < dp <= MAX_WORLD)):
        out.append(Problem("layout.dp", f"must be a positive integer or 'auto', got {dp!r}.", "set layout.dp=auto."))
    sl = spec.layout.stage_layers
    bad = [(i, x) for i, x in enumerate(sl or []) if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x <= 4096]
    if bad:
        verb = "is not a layer count" if len(bad) == 1 else "are not layer counts"
        out.append(Problem("layout.stage_layers", f"{_entries(bad)} {verb} (whole numbers 0 .. 4096, one per "
                           "pipeline stage).",
                           "e.g. layout.stage_layers=[7,8,8,7], or leave it unset."))
    return out


def _entries(bad: list[tuple[int, Any]], most: int = 8) -> str:
    """List entries by index and value: `[2]=-1, [5]=true` (the first `most`)."""
    shown = ", ".join(f"[{i}]={x!r}" for i, x in bad[:most])
    return f"entr{'y' if len(bad) == 1 else 'ies'} {shown}" + (f" (and {len(bad) - most} more)" if len(bad) > most else "")


def _tier_fields(t) -> list[str]:
    """The fields of a network tier that cannot be: `size=0`, `gbps=nan`, ..."""
    def num(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    bad = [f"size={t.size!r}"] if not (num(t.size) and t.size > 0) else []
    bad += [f"gbps={t.gbps!r}"] if t.gbps is not None and not (num(t.gbps) and t.gbps > 0) else []
    bad += [f"oversubscription={t.oversubscription!r}"] if not (num(t.oversubscription) and t.oversubscription >= 1) else []
    bad += [f"latency_us={t.latency_us!r}"] if not (num(t.latency_us) and t.latency_us >= 0) else []
    return bad




def validate(spec: Config) -> tuple[Layout | None, list[Problem], list[str]]:
    """The layout this config describes, or every reason it cannot run. The numbers were
    checked once, by make_plan (check_values); the planner's own variations stay in range."""
    problems: list[Problem] = []
    warnings: list[str] = []
    try:
        order = parse_order(spec.layout.order)
    except OrderError as e:
        problems.append(Problem("layout.order", f"{e} (got {spec.layout.order!r}).",
                                "e.g. layout.order=[tp,cp,pp,dp], layout.order=tp-cp-ep-dp-pp, or auto."))
        order = None
    if problems:
        return None, problems, warnings
    rules = _rules(spec)
    world, dp = _check_product(spec, problems)
    dp_shard = spec.layout.dp_shard or dp
    if dp and dp % dp_shard:
        problems.append(Problem("layout.dp_shard, layout.dp", f"dp={dp} does not split into copies of "
                                f"dp_shard={dp_shard} ranks each.",
                                f"use a dp_shard that divides {dp}, e.g. {[x for x in _divisors(dp)][-3:]}."))
    etp = _check_experts(spec, world, dp, dp_shard, rules, problems, warnings)
    _check_tensor(spec, etp, rules, problems, warnings)
    stage_layers = _check_pipeline(spec, problems, warnings)
    _check_sequence(spec, problems)
    _check_precision(spec, problems)
    _check_ep_overlap(spec, problems)
    mb = _check_batch(spec, dp, rules, problems, warnings)
    if problems:
        return None, problems, warnings
    lay = spec.layout
    zero = configured_zero(spec)
    if zero == 3 and lay.pp > 1 and spec.stack.pp_keeps_weights_gathered:
        zero = 2
    layout = Layout(world=world, tp=lay.tp, cp=lay.cp, pp=lay.pp, dp=dp, ep=lay.ep, etp=etp, vp=lay.vp,
                    zero=zero, dp_shard=dp_shard,
                    micro_batch=spec.training.micro_batch, microbatches=mb,
                    stage_layers=stage_layers, schedule=SCHEDULES[spec.schedule.name.value], order=order,
                    experts=spec.model.moe.experts, pipeline_rules=rules,
                    chunk_layers=(accounted_chunks(spec.stack.pipeline_accounting, spec.model.layers, lay.pp,
                                                   lay.pp * SCHEDULES[spec.schedule.name.value].chunks(lay.vp))
                                  if lay.stage_layers is None else None))
    if order is not None:
        problems += check_order(layout, order, configured_etp=default_etp(spec), written=_written(lay.order))
    if problems:
        return None, problems, warnings
    return layout, problems, warnings


def _rules(spec: Config) -> str:
    """Whose rules apply where the frameworks differ: "torch" or "megatron" (stack.pipeline_rules)."""
    return spec.stack.pipeline_rules.value


def _written(order) -> list[str] | None:
    """The axes of layout.order as written (parse_order appends the ones left out)."""
    if isinstance(order, str):
        return [x for x in order.lower().replace(",", "-").replace(" ", "-").split("-") if x.strip()] or None
    return [str(x).strip().lower() for x in order] or None if isinstance(order, (list, tuple)) else None


def _order_txt(order: list[str]) -> str:
    return "-".join(order)


def _stride(order: list[str], sizes: dict[str, int], axis: str) -> int:
    """An axis' stride: the product of the sizes of the axes inside it (innermost first)."""
    return math.prod(sizes[a] for a in order[:order.index(axis)])


def check_order(layout: Layout, order: list[str], configured_etp: int | None = None,
                written: list[str] | None = None) -> list[Problem]:
    """The rank order against the two grids (dense and expert) it builds over the same ranks.

    Every stack: a rank runs one pipeline stage, for its attention and its experts alike, so
    the pipeline groups of the two grids must be the same (Megatron-Core asserts it in
    megatron/core/parallel_state.py:903-907 initialize_model_parallel; torchtitan's ParallelDims
    puts pp outermost in both meshes). Outside Megatron only a model with experts has a second grid.

    stack.pipeline_rules=megatron: also the order ends with pp, or pp == 1, or the expert and
    dense data-parallel sizes agree (megatron/core/parallel_state.py:897-901), whatever the
    model: Megatron builds the expert grid for dense models too, with the configured etp
    (`configured_etp`, which a dense model's layout does not keep). Megatron reads the order
    string as written (`written`: the axes the user named, before the unnamed ones were appended).
    """
    d = layout
    out: list[Problem] = []
    megatron = d.pipeline_rules == "megatron"
    if d.pp == 1 or not (d.experts or megatron):
        return out
    etp = configured_etp or d.etp
    edp = d.world // (etp * d.ep * d.pp)
    dense = {"tp": d.tp, "cp": d.cp, "ep": 1, "dp": d.dp, "pp": d.pp}
    expert = {"tp": etp, "cp": 1, "ep": d.ep, "dp": edp, "pp": d.pp}
    pp_last = [a for a in order if a != "pp"] + ["pp"]
    fix = f"put pp outermost, layout.order={_order_txt(pp_last)} (or layout.order=auto)"
    if megatron and edp != d.dp and (written or order)[-1] != "pp":
        out.append(Problem("layout.order, stack", f"Megatron-Core needs the order to end with pp when the "
                           f"expert data-parallel size (edp {edp} = world / (etp {etp} x ep {d.ep} x pp "
                           f"{d.pp})) differs from the dense one (dp {d.dp}); order {_order_txt(order)} "
                           f"does not (parallel_state.py, initialize_model_parallel).", f"{fix}."))
    elif _stride(order, dense, "pp") != _stride(order, expert, "pp"):
        out.append(Problem("layout.order, layout.ep, layout.etp",
                           f"order {_order_txt(order)} gives the experts other pipeline groups than attention: "
                           f"the pp stride is {_stride(order, dense, 'pp')} in the dense grid (tp {d.tp}, cp "
                           f"{d.cp}, dp {d.dp}) and {_stride(order, expert, 'pp')} in the expert grid (etp {etp}, "
                           f"ep {d.ep}, edp {edp}), so a rank would run two different stages.",
                           f"{fix}, or pick etp x ep = tp x cp so that edp = dp."))
    return out


def _check_product(spec: Config, problems: list[Problem]) -> tuple[int, int]:
    """tp x cp x pp x dp against the allocation (torchtitan's ParallelDims message)."""
    lay, gpn, nodes = spec.layout, spec.hardware.gpus_per_node, spec.cluster.nodes
    t, c, p = lay.tp, lay.cp, lay.pp
    world, mp = nodes * gpn, lay.tp * lay.cp * lay.pp
    world_txt = f"WORLD_SIZE {world} (cluster.nodes {nodes} x hardware.gpus_per_node {gpn})"
    if lay.dp == "auto":
        if world % mp == 0:
            return world, world // mp
        fits = [n for n in range(max(1, nodes - 64), nodes + 65) if (n * gpn) % mp == 0][:1]
        fix = f"use cluster.nodes={fits[0]}" if fits else "change the degrees"
        problems.append(Problem("layout.tp, layout.cp, layout.pp, cluster.nodes",
                                f"tp({t}) * cp({c}) * pp({p}) = {mp} does not divide {world_txt}, so no dp fits.",
                                f"{fix}, or pick degrees whose product divides {world}."))
        return world, 0
    dp = lay.dp
    if mp * dp != world:
        fix = (f"dp={world // mp} would fit (or layout.dp=auto)." if world % mp == 0 else
               f"no dp fits: tp*cp*pp = {mp} does not divide {world}; change the degrees.")
        if (mp * dp) % gpn == 0:
            fix += f" This product needs cluster.nodes={mp * dp // gpn}."
        problems.append(Problem("layout.dp, cluster.nodes",
                                f"dp({dp}) * cp({c}) * tp({t}) * pp({p}) = {mp * dp} != {world_txt}.", fix))
        return world, 0
    return world, dp


def configured_zero(spec: Config) -> int:
    """layout.zero, or the stack's; the layout's own may be lower (stack.pp_keeps_weights_gathered)."""
    return spec.stack.zero if spec.layout.zero is None else spec.layout.zero


def default_etp(spec: Config) -> int:
    """layout.etp, or the stack's default: tp (Megatron, megatron/training/arguments.py:587-588)
    or 1 (torchtitan, this runtime)."""
    lay = spec.layout
    return lay.etp or (lay.tp if spec.stack.expert_tp_follows_tp else 1)


def _check_experts(spec: Config, world: int, dp: int, dp_shard: int, rules: str, problems: list[Problem],
                   warnings: list[str]) -> int:
    """The expert grid, as Megatron-Core's initialize_model_parallel builds it: etp x ep x pp
    divides the world and expert data parallelism takes the rest, so EP folds in context and
    data parallelism (and tensor parallelism where etp < tp). Returns etp."""
    lay, m = spec.layout, spec.model
    ep, pp, tp = lay.ep, lay.pp, lay.tp
    etp = default_etp(spec)
    if m.moe.experts == 0:
        # Megatron: ep > 1 needs num_experts (megatron/training/arguments.py:1654-1658); torchtitan
        # builds no expert mesh for a dense model.
        if ep > 1:
            problems.append(Problem("layout.ep, model.moe.experts", f"ep={ep} needs a mixture-of-experts model; "
                                    f"{m.name} is dense.", "set layout.ep=1."))
            return tp
        etp = lay.etp or tp  # a dense model's expert grid, where a stack builds one, is Megatron's
        if etp != tp:
            # Megatron builds the expert grid for a dense model too and refuses one that does not
            # tile the world (megatron/core/parallel_state.py:874-884); otherwise etp is unused.
            if rules == "megatron" and world % (etp * pp):
                problems.append(Problem("layout.etp", f"Megatron-Core builds the expert grid for {m.name} too: "
                                        f"etp({etp}) * pp({pp}) = {etp * pp} does not divide WORLD_SIZE {world}.",
                                        "leave layout.etp unset (a dense model has no experts)."))
                return tp
            warnings.append(f"layout.etp={etp} has no effect: {m.name} has no experts.")
        return tp
    moe = m.moe
    if not 1 <= moe.experts_per_token <= moe.experts:
        problems.append(Problem("model.moe.experts_per_token", f"each token goes to experts_per_token="
                                f"{moe.experts_per_token} of {moe.experts} experts.",
                                f"set model.moe.experts_per_token between 1 and {moe.experts}."))
    if moe.expert_ffn_hidden < 1:
        problems.append(Problem("model.moe.expert_ffn_hidden", f"{m.name} has {moe.experts} experts of width "
                                f"{moe.expert_ffn_hidden}.", "set model.moe.expert_ffn_hidden (DeepSeek-V3: 2048)."))
    if moe.dense_layers > m.layers:
        problems.append(Problem("model.moe.dense_layers", f"dense_layers={moe.dense_layers} leading dense layers "
                                f"but the model has {m.layers} layers.", f"use at most {m.layers}."))
    # Megatron: num_experts % ep (megatron/training/arguments.py:1654-1658, moe_layer.py:186);
    # torchtitan shards experts evenly over ep as well.
    if m.moe.experts % ep:
        problems.append(Problem("layout.ep, model.moe.experts", f"{m.moe.experts} experts do not split over ep={ep}.",
                                f"use ep in {_divisors(m.moe.experts)[-6:]}."))
    # megatron/core/parallel_state.py:874-884 (RuntimeError). This is the only tie between ep and
    # the dense degrees: (dp x cp) % ep is not required (torchtitan: ep divides dp_shard x cp x tp).
    if world % (etp * ep * pp):
        dense = world // (tp * lay.cp * pp) if world % (tp * lay.cp * pp) == 0 else 0
        problems.append(Problem("layout.ep, layout.etp", f"the expert grid needs etp({etp}) * ep({ep}) * pp({pp}) = "
                                f"{etp * ep * pp} to divide WORLD_SIZE {world}.",
                                f"use an ep that divides {world // (etp * pp) if world % (etp * pp) == 0 else world}"
                                + (f" (dp x cp = {dense * lay.cp})" if dense else "") + "."))
        return etp
    edp = world // (etp * ep * pp)
    copies = dp // dp_shard if dp and dp_shard and dp % dp_shard == 0 else 1
    # Megatron: the distributed optimizer's instances (HSDP's copies of the state) split the
    # expert data-parallel group too (megatron/core/parallel_state.py:1447-1449).
    if rules == "megatron" and copies > 1 and edp % copies:
        problems.append(Problem("layout.dp_shard, layout.ep, layout.etp",
                                f"{copies} copies of the state (dp {dp} / dp_shard {dp_shard}) do not split the "
                                f"expert data-parallel group of edp = {edp} ranks (Megatron-Core, "
                                f"num_distributed_optimizer_instances).",
                                f"use a dp_shard with dp / dp_shard dividing {edp}, or leave layout.dp_shard unset."))
    return etp


def _check_tensor(spec: Config, etp: int, rules: str, problems: list[Problem], warnings: list[str]) -> None:
    lay, m, gpn = spec.layout, spec.model, spec.hardware.gpus_per_node
    t = lay.tp
    if (t > gpn or gpn % t) and lay.allow_cross_node_tp:
        warnings.append(f"layout.tp={t} does not fit in a node of {gpn} GPUs: its collectives cross "
                        f"the network (allowed by layout.allow_cross_node_tp); see the TP row of the axes.")
    # Megatron: TransformerConfig.__post_init__ (megatron/core/transformer/transformer_config.py:1446-1450);
    # torch: the heads are split over the TP mesh (ColwiseParallel on q, k, v).
    if m.heads % t:
        problems.append(Problem("layout.tp, model.heads", f"{m.heads} attention heads do not split over tp={t}.",
                                f"use tp in {[d for d in _divisors(m.heads) if d <= gpn]}."))
    # Megatron: num_query_groups must be a multiple or a divisor of tp (transformer_config.py:1458-1468).
    if m.kv_heads % t:
        if t % m.kv_heads == 0:
            warnings.append(f"model.kv_heads={m.kv_heads} < tp={t}: each KV head is replicated on "
                            f"{t // m.kv_heads} TP ranks (Megatron does the same).")
        else:
            problems.append(Problem("layout.tp, model.kv_heads",
                                    f"{m.kv_heads} KV heads neither split over nor replicate evenly onto tp={t}.",
                                    f"use tp in {_divisors(m.kv_heads) + [m.kv_heads * k for k in (2, 4, 8)]}."))
    # MLP widths over their tensor-parallel group. torch (DTensor) shards unevenly: padded, a
    # warning. Megatron: ColumnParallelLinear/RowParallelLinear divide() the width by the group
    # size and assert (megatron/core/tensor_parallel/layers.py:1038 and :1408, core/utils.py
    # divide); experts use the expert-TP group (etp), shared experts the dense one (tp).
    moe = m.moe
    widths = []
    if not moe.experts or moe.dense_layers:
        widths.append(("model.ffn_hidden", "layout.tp", m.ffn_hidden, t))
    if moe.experts:
        widths.append(("model.moe.expert_ffn_hidden", "layout.etp", moe.expert_ffn_hidden, etp))
        if moe.shared_experts:
            widths.append(("model.moe.shared_experts, model.moe.expert_ffn_hidden", "layout.tp",
                           moe.shared_experts * moe.expert_ffn_hidden, t))
    for key, deg_key, width, deg in widths:
        if width % deg == 0:
            continue
        if rules == "megatron":
            problems.append(Problem(f"{deg_key}, {key}", f"an MLP width of {width} does not split over "
                                    f"{deg_key.split('.')[1]}={deg}; Megatron-Core's parallel linear layers need it "
                                    f"to (tensor_parallel/layers.py, divide).",
                                    f"use {deg_key.split('.')[1]} in {[d for d in _divisors(width) if d <= 64][-4:]}, "
                                    f"or a width divisible by {deg}."))
        else:
            warnings.append(f"{key}={width} is not divisible by {deg_key.split('.')[1]}={deg}: padded to "
                            f"{-(-width // deg) * deg}.")
    # Megatron: MoELayer.forward raises ValueError in training when attention TP > 1 runs without
    # sequence parallelism (megatron/core/transformer/moe/moe_layer.py:636-640).
    if rules == "megatron" and moe.experts and t > 1 and not lay.sequence_parallel:
        problems.append(Problem("layout.sequence_parallel, layout.tp", f"Megatron-Core's MoE layer refuses to "
                                f"train with tp={t} and no sequence parallelism (moe_layer.py, MoELayer.forward).",
                                "set layout.sequence_parallel=true, or layout.tp=1."))
    if m.vocab % t:  # both pad the vocabulary (megatron/training/vocab_utils.py; DTensor's uneven shards)
        warnings.append(f"model.vocab={m.vocab} is not divisible by tp={t}: the vocabulary-parallel "
                        f"embedding pads it to {-(-m.vocab // t) * t}.")


def stage_split(want: list[int], layers: int, pp: int, least: int) -> list[int] | None:
    """A valid layout.stage_layers near a wrong one: pp entries summing to `layers`, each at
    least `least`; the layers above the minimum shared as `want` weights them (its entries above
    the minimum, when it has pp entries), else evenly with the ends lighter (uneven_split)."""
    spare = layers - pp * least
    if spare < 0:
        return None
    weights = [max(x - least, 0) for x in want] if len(want) == pp else []
    if not sum(weights):
        even = uneven_split(layers, pp) or ([layers // pp] * pp if layers % pp == 0 else None)
        if even and min(even) >= least:
            return even
        weights = [1] * pp
    shares = [spare * w / sum(weights) for w in weights]
    split = [least + int(x) for x in shares]
    for i in sorted(range(pp), key=lambda i: int(shares[i]) - shares[i])[:layers - sum(split)]:
        split[i] += 1  # largest remainders first
    return split


def uneven_split(layers: int, pp: int) -> list[int] | None:
    """An uneven split that lightens the ends, which also hold the embedding and the
    output layer: Llama 3 405B's 126 layers on 16 stages are [7, 8, ..., 8, 7]."""
    if pp < 2 or layers < pp or layers % pp == 0:
        return None
    k = -(-layers // pp)
    split = [k] * pp
    deficit = k * pp - layers
    ends = [i for pair in zip(range(pp), reversed(range(pp))) for i in pair]
    for i in ends[:deficit]:
        split[i] -= 1
    return split if min(split) >= 1 and sum(split) == layers else None


def accounted_chunks(mode: PipelineAccounting, L: int, p: int, n: int) -> list[int] | None:
    """Transformer layers per virtual stage (pipeline order) when the stack counts the
    embedding and the loss as a layer each (stack.pipeline_accounting; Megatron-Core's
    --account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split: the
    layers plus those two split evenly over pp x vp, the first and last stage build one fewer).
    `n`: virtual stages (pp x model chunks per rank). None where only transformer layers fill
    the stages. `mode`: stack.pipeline_accounting."""
    if p < 2 or mode == PipelineAccounting.layers or (mode == PipelineAccounting.auto and L % n == 0) or \
            (L + 2) % n or (L + 2) // n < 1:
        return None
    sizes = [(L + 2) // n] * n
    sizes[0] -= 1
    sizes[-1] -= 1
    return sizes if min(sizes) >= 0 and sum(sizes) == L else None


def _check_pipeline(spec: Config, problems: list[Problem], warnings: list[str]) -> list[int]:
    """Layers against pp x vp, and the schedule's own rules for virtual stages."""
    lay, L = spec.layout, spec.model.layers
    p, v = lay.pp, lay.vp
    sched = SCHEDULES[spec.schedule.name.value]
    if v > 1 and not sched.uses_vp:
        problems.append(Problem("layout.vp, schedule.name", f"vp={v} virtual stages need an interleaved schedule, "
                                f"not {sched.name}.", "use schedule=interleaved_1f1b, or layout.vp=1."))
        return []
    if sched.uses_vp and p == 1 and v > 1:
        # Megatron: initialize_model_parallel raises RuntimeError ("pipeline-model-parallel size
        # should be greater than 1 with interleaved schedule", megatron/core/parallel_state.py:
        # 827-831; megatron/training/arguments.py:1000-1010). Every stack: one stage has nothing
        # to interleave with.
        problems.append(Problem("layout.vp, layout.pp", f"vp={v} virtual stages interleave pipeline stages, "
                                f"but pp=1 has one stage: {sched.name} needs pp > 1.",
                                f"set layout.vp=1, or layout.pp > 1 (e.g. layout.pp="
                                f"{next((d for d in _divisors(L) if d > 1 and (L // d) % v == 0), 2)})."))
        return []
    chunks = sched.chunks(v)
    if lay.stage_layers is not None:  # written by hand: as written, whatever the stack's accounting
        sl = list(lay.stage_layers)
        wrong = []
        if len(sl) != p:
            wrong.append(f"it has {len(sl)} entries, layout.pp={p} stages need one each")
        if sum(sl) != L:
            wrong.append(f"its entries sum to {sum(sl)}, model.layers is {L}")
        low = [(i, x) for i, x in enumerate(sl) if x < chunks]
        if low:
            wrong.append(f"{_entries(low)} {'is' if len(low) == 1 else 'are'} below {chunks}: each pipeline rank "
                         f"holds {chunks} model chunk(s) ({sched.name}, layout.vp={v}), each at least one layer")
        if wrong:
            split = stage_split(sl, L, p, chunks)
            if split:
                fix = f"e.g. layout.stage_layers=[{','.join(map(str, split))}]" + (
                    " (your split, each entry raised to the minimum, the rest shared as you weighted it)"
                    if len(sl) == p and low else "") + "."
            else:  # no split of L layers gives every rank its chunks: fewer virtual stages
                fewer = next((x for x in range(v - 1, 0, -1) if p * sched.chunks(x) <= L), None)
                alt = stage_split(sl, L, p, sched.chunks(fewer)) if fewer else None
                fix = (f"{p} stages x {chunks} chunk(s) need at least {p * chunks} layers, model.layers is {L}: " +
                       (f"e.g. layout.vp={fewer} layout.stage_layers=[{','.join(map(str, alt))}]" if alt and fewer > 1
                        else f"use layout.vp=1 or fewer stages (layout.pp <= {L // max(sched.chunks(1), 1)})") + ".")
            problems.append(Problem("layout.stage_layers", "; ".join(wrong) + ".", fix))
            return []
        return sl
    if p > L:
        problems.append(Problem("layout.pp, model.layers", f"pp={p} stages for {L} layers.", f"use pp <= {L}."))
        return []
    accounted = accounted_chunks(spec.stack.pipeline_accounting, L, p, p * chunks)
    if L % (p * chunks) == 0 and accounted is None:
        return [L // p] * p
    if accounted is not None:
        if spec.stack.pipeline_accounting == PipelineAccounting.auto:
            warnings.append(f"model.layers={L} does not split into pp({p}) x {chunks} chunk(s); planned with the "
                            f"embedding and the loss counted as a layer each ({L} + 2 = {L + 2}), as Megatron-Core "
                            f"runs it with --account-for-embedding-in-pipeline-split and "
                            f"--account-for-loss-in-pipeline-split (stack.pipeline_accounting=auto); without them "
                            f"it refuses this split.")
        return [sum(accounted[j] for j in sched.stages_of_rank(r, p, v)) for r in range(p)]
    alt = uneven_split(L, p)
    good_vp = [x for x in _divisors(L // p) if x <= 8] if L % p == 0 and sched.uses_vp else []
    fix = []
    if alt and min(alt) >= chunks:
        fix.append(f"split unevenly with layout.stage_layers=[{','.join(map(str, alt))}] "
                   f"(first and last stage one layer fewer, as Llama 3 405B)")
    if good_vp:
        fix.append(f"use vp in {good_vp}")
    if accounted_chunks(PipelineAccounting.embedding_loss, L, p, p * chunks):
        fix.append("count the embedding and the loss as a layer each (stack.pipeline_accounting=embedding_loss, "
                   "Megatron-Core's --account-for-embedding/loss-in-pipeline-split)")
    fix.append(f"use pp in {[d for d in _divisors(L) if 1 < d <= 128][:8]}")
    problems.append(Problem("layout.pp, layout.vp, model.layers",
                            f"model.layers={L} does not split into pp({p}) x {chunks} chunk(s) = {p * chunks} "
                            f"equal parts.", "; or ".join(fix) + "."))
    return []


def _check_sequence(spec: Config, problems: list[Problem]) -> None:
    lay, s = spec.layout, spec.training.seq_len
    t, c = lay.tp, lay.cp
    if c > 1 and s % (2 * c):
        problems.append(Problem("training.seq_len, layout.cp",
                                f"context parallelism cuts the sequence into 2 x cp = {2 * c} load-balanced chunks; "
                                f"seq_len {s} is not divisible by {2 * c}.",
                                f"use seq_len={-(-s // (2 * c)) * 2 * c} or a cp that divides {s // 2}."))
    elif t > 1 and lay.sequence_parallel and (s // c) % t:
        problems.append(Problem("training.seq_len, layout.tp", f"sequence parallelism shards each rank's {s // c} "
                                f"tokens over tp={t}, which does not divide them.",
                                "use a seq_len divisible by cp*tp, or layout.sequence_parallel=false."))


def _check_precision(spec: Config, problems: list[Problem]) -> None:
    """MXFP8 and NVFP4 need Blackwell's block-scaled tensor cores (the preset's FP4 peak says so)."""
    p, hw = spec.training.precision.value, spec.hardware
    if p in ("mxfp8", "nvfp4") and not hw.peak_fp4_tflops:
        problems.append(Problem("training.precision, hardware.peak_fp4_tflops",
                                f"{p} runs on block-scaled tensor cores (Blackwell); hardware={hw.name} has none "
                                f"(no peak_fp4_tflops).", "use training.precision=fp8 or bf16 here, or a Blackwell "
                                "preset (hardware=b200, gb200, gb300)."))
    if spec.training.bf16_layers > spec.model.layers:
        problems.append(Problem("training.bf16_layers", f"{spec.training.bf16_layers} layers kept in BF16, but "
                                f"{spec.model.name} has {spec.model.layers}.",
                                f"set training.bf16_layers to at most {spec.model.layers}."))


# Megatron-Core's combined 1F1B (stack.ep_overlap), as TransformerConfig.__post_init__ asserts it
# (megatron/core/transformer/transformer_config.py:3002-3047 at NVIDIA/Megatron-LM@d98e8a6) and the
# schedules run it: forward_backward_no_pipelining (pp=1) and forward_backward_pipelining_with_interleaving
# (megatron/core/pipeline_parallel/schedules.py:778, 1485); the non-interleaved pipeline has no combined path.
_EP_OVERLAP_SRC = "Megatron-Core's combined 1F1B (transformer_config.py:3002-3047)"


def _check_ep_overlap(spec: Config, problems: list[Problem]) -> None:
    how = spec.stack.ep_overlap.value
    if how == "none":
        return
    lay, tr, sched = spec.layout, spec.training, SCHEDULES[spec.schedule.name.value]
    off = "or stack.ep_overlap=none."
    if lay.ep <= 1 or not spec.model.moe.experts:
        problems.append(Problem("stack.ep_overlap, layout.ep", f"{_EP_OVERLAP_SRC} overlaps the expert all-to-all "
                                f"and needs expert parallelism; ep={lay.ep} ({spec.model.name}).",
                                "set layout.ep>1 on a mixture-of-experts model, " + off))
    if sched.overlaps_ep or (lay.pp > 1 and (sched.name != "interleaved_1f1b" or lay.vp < 2)):
        problems.append(Problem("stack.ep_overlap, schedule.name, layout.vp",
                                f"{_EP_OVERLAP_SRC} runs without pipelining or in the interleaved 1F1B "
                                f"('virtual_pipeline_model_parallel_size must be specified when "
                                f"pipeline_model_parallel_size > 1'); pp={lay.pp}, vp={lay.vp}, schedule={sched.name}.",
                                "use schedule=interleaved_1f1b with layout.vp>=2 (or layout.pp=1), " + off))
    if tr.recompute.value == "full":
        problems.append(Problem("stack.ep_overlap, training.recompute", f"{_EP_OVERLAP_SRC} refuses full "
                                "recomputation ('disable full recomputation when enabling "
                                "overlap_moe_expert_parallel_comm').", "use training.recompute=selective or none, " + off))
    if tr.precision.value == "fp32":
        problems.append(Problem("stack.ep_overlap, training.precision", f"{_EP_OVERLAP_SRC} runs only with a bf16 "
                                "or fp16 model; precision=fp32.", "use training.precision=bf16 (or fp8), " + off))
    if tr.mtp_depth > 1:
        problems.append(Problem("stack.ep_overlap, training.mtp_depth", f"{_EP_OVERLAP_SRC} supports at most one "
                                f"MTP layer; mtp_depth={tr.mtp_depth}.", "use training.mtp_depth<=1, " + off))


def _check_uneven(spec: Config, dp: int, problems: list[Problem]) -> int:
    """An uneven split: whole micro-batches, at least one per replica, a dense model. The slowest
    replica's count (the schedule runs it on every replica; the others' extra ones weigh nothing)."""
    tr = spec.training
    B, b, where = tr.global_batch, tr.micro_batch, "training.uneven_batch, training.global_batch"
    if B % b:
        problems.append(Problem(where + ", training.micro_batch", f"global_batch {B} is not a multiple of "
                                f"micro_batch {b}.", f"use training.micro_batch=1 or a divisor of {B}."))
    elif B // b < dp:
        problems.append(Problem(where + ", layout.dp", f"{B // b} micro-batches of {b} cannot give each of dp {dp} "
                                f"replicas one.", f"use layout.dp<={B // b} or a larger global_batch."))
    elif spec.model.moe.experts:
        problems.append(Problem(where + ", model.moe.experts", "an uneven split is for dense models (the expert "
                                "load would count unequal replicas).", "use a global_batch divisible by dp x "
                                "micro_batch, or training.uneven_batch=false."))
    return -(-(B // b) // dp)


def _check_batch(spec: Config, dp: int, rules: str, problems: list[Problem], warnings: list[str]) -> int:
    """The global batch against data parallelism, micro-batches against the schedule as the
    stack implements it (config/schedules.py: one rule per schedule and stack, with its source)."""
    tr, p = spec.training, spec.layout.pp
    B, b = tr.global_batch, tr.micro_batch
    if not dp:
        return 0
    # Megatron: ConstantNumMicroBatchesCalculator asserts it (megatron/core/num_microbatches_calculator.py
    # :367-392); torch: the runtime splits each replica's batch into equal micro-batches, or with
    # training.uneven_batch the first (B/b) % dp replicas take one more (train/data.py share).
    uneven = tr.uneven_batch and B % (dp * b)
    if uneven:
        before = len(problems)
        mb = _check_uneven(spec, dp, problems)
        if len(problems) > before:
            return 0
    elif B % (dp * b):
        lo = (B // (dp * b)) * dp * b or dp * b
        problems.append(Problem("training.global_batch, layout.dp, training.micro_batch",
                                f"global_batch {B} is not a multiple of dp {dp} x micro_batch {b} = {dp * b}.",
                                f"use training.global_batch={lo} or {lo + dp * b}" +
                                (", or training.micro_batch=1" if b > 1 and B % dp == 0 else "") + "."))
        return 0
    else:
        mb = B // (dp * b)
    if spec.schedule.microbatches not in (None, mb):
        problems.append(Problem("schedule.microbatches", f"set to {spec.schedule.microbatches}, but global_batch "
                                f"{B} / (dp {dp} x micro_batch {b}) = {mb}.", "leave schedule.microbatches unset."))
    if p == 1:
        return mb
    sched = SCHEDULES[spec.schedule.name.value]
    rule = sched.rule(rules)
    chunks = sched.chunks(spec.layout.vp)
    bubble = sched.bubble(p, spec.layout.vp)
    where = f"dp {dp} x micro_batch {b} out of global_batch {B}"
    who = f"stack={spec.stack.name} ({rule.stack} rules, {rule.source})"
    why = rule.refuse(p, chunks, mb)
    if why and uneven and rule.smallest_m(p, chunks, mb):  # the schedule runs more; the extra ones weigh nothing
        mb = rule.smallest_m(p, chunks, mb)
        why = rule.refuse(p, chunks, mb)
    if why:
        target = rule.smallest_m(p, chunks, mb)
        fix = (f"make global_batch / (dp x micro_batch) {target}, e.g. training.global_batch={target * dp * b}, "
               f"or lower training.micro_batch, or use fewer stages" if target else
               "no micro-batch count helps: change layout.pp as the message says, or schedule.name")
        if rule.stack == "torch" and sched.rule("megatron").refuse(p, chunks, mb) is None:
            fix += f" (stack=megatron_core's {sched.name} would run m={mb})"
        problems.append(Problem("schedule.name, training.global_batch, layout.pp",
                                f"{sched.name} {why} under {who} ({where}).", fix + "."))
        return mb
    slow = rule.warn(p, chunks, mb)
    if slow:
        full = p  # a warning is a 1F1B rule: pp micro-batches fill the pipeline
        warnings.append(f"schedule.name, training.global_batch, layout.pp: {sched.name} {slow} under {who}; it "
                        f"runs, but the bubble is {bubble / (mb + bubble):.0%} of the step ({where}), against "
                        f"{bubble / (full + bubble):.0%} with {full} micro-batches "
                        f"(training.global_batch={full * dp * b}).")
    return mb
