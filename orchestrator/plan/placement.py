"""The plan placed on real hosts: which host runs each logical node, the tier each axis'
groups span there, and the step re-costed on those tiers. Torch-free.

The plan's tiers (plan.axes[a].tier) assume the fabric preset's idealised blocks; here
the groups are looked up on the allocation's real switches (plan/allocation.py), and the
achieved tiers replace the ideal ones in the same cost model. A user sees this before
submitting with `cluster.topology=FILE cluster.nodelist=HOSTLIST` (launcher=dry); the
SLURM job does it again on the allocation it got, at every attempt (launch/hosts.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
import numpy as np

from orchestrator.config.errors import Problem
from orchestrator.plan.allocation import Topology, TopologyError, assign, choose, host_ids, read_topology, span_levels
from orchestrator.plan.axes import AXES
from orchestrator.plan.hostlist import HostlistError, expand
from orchestrator.plan.topology import Tier, tiers_for

@dataclass
class Placement:
    nodes: list[str]  # host of each logical node
    tiers: dict[str, str]  # axis -> the tier its groups span on these hosts
    ideal: dict[str, str]  # axis -> the tier the plan assumed
    step_s: float | None  # predicted step on these hosts
    ideal_step_s: float
    name_order_step_s: float | None  # the same hosts mapped in name order
    source: str
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"nodes": self.nodes, "tiers": self.tiers, "ideal_tiers": self.ideal, "step_s": self.step_s,
                "ideal_step_s": self.ideal_step_s, "name_order_step_s": self.name_order_step_s,
                "topology": self.source, "warnings": self.warnings}


def chunk_of(plan) -> int:
    """Logical nodes in the innermost group that spans nodes (1 when none is node-aligned)."""
    gpn, grid, prod = plan.spec.hardware.gpus_per_node, plan.grid(), 1
    for a in plan.order:
        prod *= grid.sizes.get(a, 1)
        if prod > gpn:
            return prod // gpn if prod % gpn == 0 else 1
    return 1


def _tier_of_level(tiers: list[Tier], level: int, top: int) -> Tier:
    if level < 0:
        return tiers[0]
    return tiers[-1] if level >= top else tiers[min(1 + level, len(tiers) - 1)]


def achieved_tiers(plan, topo: Topology | None, hosts: list[str]) -> dict[str, Tier]:
    """Axis -> the tier its most spread group spans when logical node k runs on hosts[k]."""
    spec = plan.spec
    tiers, gpn = tiers_for(spec), spec.hardware.gpus_per_node
    ids, blocks = host_ids(topo, hosts)
    if not spec.fabric.nvlink_domain or spec.fabric.nvlink_domain <= gpn:
        blocks = None  # blocks are NVLink domains only where the fabric has them
    grids = {"dense": plan.grid(), "expert": plan.expert_grid()}
    out = {}
    for name, report in plan.axes.items():
        if not _moves(name, report):
            continue
        axis = AXES[name]
        groups = grids[axis.grid].groups(axis.members) // gpn
        level = int(span_levels((ids, blocks), groups).max()) if groups.shape[1] > 1 else -2
        out[name] = _streams(plan, name, _tier_of_level(tiers, level, ids.shape[0]), ids, groups, level)
    return out


def _moves(name: str, report) -> bool:
    """As the report lists axes: one of size 1, or one that moves nothing, does not matter here."""
    return report.size > 1 and bool(report.calls_per_step or name in ("tp", "cp", "pp"))


STREAMED = ("pp", "cp", "dp", "edp")  # the axes whose rings/chains the cost model slows by streams per block


def _streams(plan, name: str, tier: Tier, ids: np.ndarray, groups: np.ndarray, level: int) -> Tier:
    """On an oversubscribed tier the cost model slows a ring only when a block below it holds
    fewer members of a group than the oversubscription (cost._stream_gbps), counting members
    on the ideal rank blocks; here they are counted under the real switches, and the tier's
    bandwidth scaled so that the cost model's own rule gives the real count's bandwidth."""
    from orchestrator.plan.cost import _members_per_block, _oversubscribed

    factor, block = _oversubscribed(plan.spec).get(tier.name, (1.0, 0))
    if factor <= 1.0 or name not in STREAMED or level < 0:
        return tier
    below = groups if level == 0 else ids[min(level, ids.shape[0]) - 1][groups]
    rows = np.sort(below, axis=1) + np.arange(below.shape[0])[:, None] * (int(below.max()) + 1)
    here = int(np.unique(rows.ravel(), return_counts=True)[1].min())  # fewest members under one switch
    ideal = _members_per_block(plan.layout, plan.order, name, block)
    return replace(tier, gbps=tier.gbps * min(factor, here) / min(factor, ideal))


def recost(plan, tiers: dict[str, Tier]) -> float | None:
    """The plan's predicted step with these tiers in place of its own."""
    from orchestrator.plan.plan import Plan, cost_plan, shape_plan

    shaped = shape_plan(plan.spec, order_override=plan.order)
    if isinstance(shaped, Plan):
        return None
    shaped.tiers = {**shaped.tiers, **tiers}
    shaped.axes = {**shaped.axes, **{n: replace(shaped.axes[n], tier=t.name, gbps=t.gbps, latency_us=t.latency_us)
                                     for n, t in tiers.items()}}
    shaped.blast_radius = plan.blast_radius
    return cost_plan(shaped, plan.spec).step.wall_s


def place(plan, hosts: list[str], topo: Topology | None, source: str = "") -> Placement:
    """Choose the plan's nodes among `hosts` and map its logical nodes onto them by topology."""
    need = plan.spec.cluster.nodes
    if topo is None:  # nothing known about the network: the hosts in their order, the plan's own tiers
        return Placement(list(hosts[:need]), {n: a.tier for n, a in plan.axes.items() if _moves(n, a)},
                         {n: a.tier for n, a in plan.axes.items() if _moves(n, a)}, plan.step.wall_s,
                         plan.step.wall_s, plan.step.wall_s, "none: hosts in their order, the fabric preset's tiers")
    mapped = assign(topo, choose(topo, hosts, need), chunk_of(plan))
    here = achieved_tiers(plan, topo, mapped)
    names = achieved_tiers(plan, topo, list(hosts[:need]))
    ideal = {n: a.tier for n, a in plan.axes.items() if n in here}
    step, name_step = recost(plan, here), recost(plan, names)
    pl = Placement(mapped, {n: t.name for n, t in here.items()}, ideal, step, plan.step.wall_s, name_step,
                   source or (topo.source if topo else "none"))
    rank = {t.name: i for i, t in enumerate(tiers_for(plan.spec))}
    worse = [n for n, t in here.items() if rank[t.name] > rank.get(ideal[n], 0)]
    if worse and step is not None and step > plan.step.wall_s:
        spread = ", ".join(f"{n} spans {here[n].name} (plan: {ideal[n]})" for n in worse)
        pl.warnings.append(f"placement: this allocation is more scattered than the plan assumed: {spread}; predicted "
                           f"step {step:.4g} s instead of {plan.step.wall_s:.4g} s "
                           f"({step / plan.step.wall_s - 1:+.1%}). Ask SLURM for fewer switches "
                           f"(launcher.switches=N[@max-wait]) or re-plan for this allocation.")
    return pl


def attach(plan) -> None:
    """cluster.topology / cluster.nodelist given: place the plan on them (plan.placement),
    or say what is wrong with them (plan.errors)."""
    cl = plan.spec.cluster
    if plan.step is None or not (cl.topology or cl.nodelist):
        return
    try:
        topo = read_topology(str(cl.topology) if cl.topology else None)
        hosts = expand(str(cl.nodelist)) if cl.nodelist else sorted(set(topo.leaf) | set(topo.block)) if topo else []
    except (TopologyError, HostlistError) as e:
        key = "cluster.nodelist" if isinstance(e, HostlistError) else "cluster.topology"
        plan.errors.append(Problem(key, str(e), "give a SLURM topology.conf (SwitchName=... Nodes=...) and a "
                                   "hostlist such as node[1-4,7]."))
        plan.valid = False
        return
    if len(hosts) < cl.nodes:
        plan.errors.append(Problem("cluster.nodelist, cluster.nodes", f"{len(hosts)} host(s) for a plan of "
                                   f"cluster.nodes={cl.nodes}.", "list at least cluster.nodes hosts."))
        plan.valid = False
        return
    pl = place(plan, hosts, topo)
    off = [h for h in pl.nodes if h not in topo.leaf and h not in topo.block] if topo is not None else []
    if off:
        pl.warnings.append(f"placement: {len(off)} host(s) are not in the topology ({', '.join(off[:4])}"
                           f"{', ...' if len(off) > 4 else ''}); their groups count as crossing the top tier.")
    plan.placement = pl
    plan.warnings += pl.warnings
