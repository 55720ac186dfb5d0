"""Placement on a scattered allocation: the Llama 3 405B recipe (8,192 H100, TP8 PP16 DP64,
fabric=llama3_meta) on a simulated 1,024-node allocation over 32 leaf switches of 32 nodes,
12 leaves per 3,072-GPU pod, three pods under an oversubscribed (1:7) top switch. Host names
are dealt to the leaves in random order, so the name order (what `scontrol show hostnames`
gives, and what the launcher used before) says nothing about the network.

Prints, for the name-order mapping and the topology-aware one (plan/placement.py): the tier
each axis' groups span and the predicted step re-costed on those tiers; then what the mapping
itself costs in seconds (choosing and ordering the hosts, and finding the tiers) on 1,024 and
on 16,384 nodes.

Run: .venv/bin/python benchmarks/placement.py [--seed N]
"""
from __future__ import annotations

import argparse
import random
import time

from orchestrator import compose, make_plan
from orchestrator.plan.allocation import assign, choose, parse_topology, tree_conf
from orchestrator.plan.placement import achieved_tiers, chunk_of, place, recost

LEAF = 32  # nodes per leaf switch
PER_POD = 12  # leaves per pod: 12 x 32 nodes x 8 GPUs = 3,072 GPUs (llama3_meta's pod)


def allocation(nodes: int, seed: int) -> tuple[list[str], str]:
    """Host names in name order, and the topology.conf text of the simulated tree."""
    names = [f"gpu{i:05d}" for i in range(nodes)]
    dealt = random.Random(seed).sample(names, nodes)
    return names, tree_conf([dealt[i:i + LEAF] for i in range(0, nodes, LEAF)], per_pod=PER_POD)


def mapping_seconds(plan, names, text, runs: int = 3) -> tuple[float, float]:
    """Best of `runs`, each on a freshly read topology (nothing memoised): (choose + assign,
    achieved tiers of every group) in seconds."""
    best = [float("inf"), float("inf")]
    for _ in range(runs):
        topo = parse_topology(text)
        t0 = time.perf_counter()
        mapped = assign(topo, choose(topo, names, plan.spec.cluster.nodes), chunk_of(plan))
        t1 = time.perf_counter()
        achieved_tiers(plan, topo, mapped)
        t2 = time.perf_counter()
        best = [min(best[0], t1 - t0), min(best[1], t2 - t1)]
    return best[0], best[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    plan = make_plan(compose(["recipe=llama3_405b", "figures=false"]))
    plan.raise_if_invalid()
    names, text = allocation(plan.spec.cluster.nodes, args.seed)
    topo = parse_topology(text)
    print(f"Llama 3 405B recipe: {plan.layout.label()} order {'-'.join(plan.order)} on {plan.world_size} GPUs "
          f"({plan.spec.cluster.nodes} nodes), fabric {plan.spec.fabric.name}")
    print(f"allocation: {len(names)} nodes over {len(names) // LEAF} leaf switches of {LEAF}, {PER_POD} leaves per "
          f"pod, host names dealt to leaves at random (seed {args.seed})")
    print(f"plan as costed on the fabric's ideal tiers: step {plan.step.wall_s:.3f} s, "
          + ", ".join(f"{a}: {t.tier}" for a, t in plan.axes.items() if a in achieved_tiers(plan, topo, names)))
    mapped = assign(topo, choose(topo, names, plan.spec.cluster.nodes), chunk_of(plan))
    for label, hosts in (("name order", names), ("topology-aware", mapped)):
        tiers = achieved_tiers(plan, topo, hosts)
        step = recost(plan, tiers)
        print(f"  {label:<15} step {step:.3f} s ({step / plan.step.wall_s - 1:+.1%} vs ideal)  MFU "
              f"{plan.mfu * plan.step.wall_s / step:.1%}  tiers: " + ", ".join(f"{a}: {t.name}" for a, t in tiers.items()))
    for nodes in (plan.spec.cluster.nodes, 16384):
        big = plan if nodes == plan.spec.cluster.nodes else make_plan(compose(
            ["recipe=llama3_405b", "figures=false", f"cluster.nodes={nodes}", f"layout.dp={nodes * 8 // 128}",
             f"training.global_batch={nodes * 2}"]))
        big.raise_if_invalid()
        names_n, text_n = allocation(nodes, args.seed)
        m, t = mapping_seconds(big, names_n, text_n)
        t0 = time.perf_counter()
        place(big, names_n, parse_topology(text_n))
        whole = time.perf_counter() - t0
        print(f"mapping cost on {nodes:,} nodes: choose+assign {m:.3f} s, tiers of every group {t:.3f} s "
              f"(best of 3); the whole placement with both re-costed steps {whole:.3f} s")


if __name__ == "__main__":
    main()
