"""The hosts of each attempt's logical nodes inside a SLURM job, by the cluster's topology.

Before each attempt's step the supervisor's workers (launch/srun.py) ask `for_attempt`
which hosts run the plan's logical nodes, in order: the plan's nodes chosen among those
in service (after a failover, the survivors; a spare close to its group) and mapped by
plan/placement.py on the topology SLURM reports (topology/tree or topology/block; or
cluster.topology). The placement goes into the attempt's plan.json and plan.md and the log.
"""
from __future__ import annotations

import json
from pathlib import Path

from orchestrator import rundir
from orchestrator.plan import make_plan
from orchestrator.plan.allocation import TopologyError, read_topology
from orchestrator.plan.placement import place
from orchestrator.report.markdown import placement_lines

START, END = "<!-- placement: start -->", "<!-- placement: end -->"


def for_attempt(spec, plan_dir: Path, nodes: list[str], need: int, say=print) -> list[str]:
    """In the SLURM job, before each attempt's step: the hosts of the plan's logical nodes
    on this allocation (survivors after a failover), chosen and ordered by the cluster's
    topology; recorded in plan_dir's plan.json (`placement`) and plan.md, and said in the log.
    Without a topology (no tree/block plugin, no cluster.topology) the nodes keep their order."""
    try:
        topo = read_topology(spec.cluster.topology)
    except TopologyError as e:
        say(f"placement: topology not read ({e}); hosts in name order")
        topo = None
    if topo is None:
        return list(nodes[:need])
    path = Path(plan_dir) / rundir.PLAN_JSON
    data = json.loads(path.read_text())
    plan = make_plan(data["config"])
    if plan.step is None:  # the job checks its plan elsewhere; placement only needs one to cost
        say("placement: the plan could not be costed again; hosts in name order")
        return list(nodes[:need])
    pl = place(plan, list(nodes), topo)
    data["placement"] = pl.to_json()
    rundir.write_json(path, data, indent=2)  # strict, and whole: a rank reading it never sees half
    text = placement_lines(pl) + [f"warning: {w}" for w in pl.warnings]
    md = Path(plan_dir) / rundir.PLAN_MD
    if md.exists():
        old = md.read_text()
        if START in old:
            old = old[:old.index(START)] + old[old.index(END) + len(END):].lstrip("\n")
        md.write_text(old.rstrip("\n") + "\n\n" + "\n".join([START, "## Placement on the allocation", "", "```",
                                                             *text[1:], "```", END, ""]))
    for line in text:
        say(line)
    return pl.nodes
