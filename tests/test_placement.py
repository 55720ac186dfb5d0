"""Placement on the allocation's real topology (issue 26): hostlists, SLURM topology files
and `scontrol show topology`, the logical node -> host mapping and its re-costed step."""
import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import plan_of, run_cli
from orchestrator.plan.allocation import assign, choose, parse_topology, tree_conf
from orchestrator.plan.hostlist import HostlistError, compress, expand
from orchestrator.plan.placement import achieved_tiers, place

TWO_LEAVES = "SwitchName=leaf1 Nodes=node[1,3]\nSwitchName=leaf2 Nodes=node[2,4]\nSwitchName=spine Switches=leaf[1-2]\n"
LEAF_SPINE = "fabric.tiers=[{name:leaf,size:2,latency_us:5},{name:spine,size:1024,oversubscription:4,latency_us:10}]"
TINY = ["hardware=cpu", "model=tiny", "figures=false", "training.seq_len=64", "training.global_batch=16",
        "hardware.gpus_per_node=1", LEAF_SPINE]


def test_hostlists_expand_as_slurm_writes_them():
    assert expand("node[1-3,7]") == ["node1", "node2", "node3", "node7"]
    assert expand("gpu[08-10]-ib,login") == ["gpu08-ib", "gpu09-ib", "gpu10-ib", "login"]
    assert expand("r[1-2]n[1-2]") == ["r1n1", "r1n2", "r2n1", "r2n2"]
    assert expand("a1,a1,b") == ["a1", "b"]
    for bad in ("node[1-", "node]", "node[3-1]", "node[x]", "node[1-2[3]]"):
        with pytest.raises(HostlistError):
            expand(bad)


def test_a_host_list_is_written_compactly_and_names_the_same_hosts_in_the_same_order():
    assert compress([f"node{i:04d}" for i in range(1, 1025)]) == "node[0001-1024]"  # a 1,024-node allocation
    assert compress(["node1", "node2", "node3", "node7"]) == "node[1-3,7]"  # as SLURM writes it
    assert compress(["gpu08-ib", "gpu09-ib", "gpu10-ib", "login"]) == "gpu[08-10]-ib,login"
    assert compress(["n3"]) == "n3"


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["n", "gpu", "r1n"]), st.integers(0, 120), st.sampled_from([0, 3])),
                min_size=1, max_size=40, unique=True))
def test_compress_then_expand_gives_the_hosts_back(hosts):
    names = list(dict.fromkeys(f"{p}{str(i).zfill(w)}" for p, i, w in hosts))
    assert expand(compress(names)) == names


@settings(max_examples=100, deadline=None)
@given(st.sets(st.integers(0, 300), min_size=1, max_size=60))
def test_a_bracketed_set_of_ranges_names_exactly_its_hosts(numbers):
    xs, ranges = sorted(numbers), []
    for x in xs:  # consecutive runs -> lo-hi, as SLURM compresses them
        if ranges and ranges[-1][1] == x - 1:
            ranges[-1][1] = x
        else:
            ranges.append([x, x])
    expr = "n[" + ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in ranges) + "]"
    assert expand(expr) == [f"n{x}" for x in xs]


def test_topology_conf_and_scontrol_output_read_the_same_tree():
    conf = parse_topology(TWO_LEAVES + "# a comment\n")
    shown = parse_topology("SwitchName=leaf1 Level=0 LinkSpeed=1 Nodes=node[1,3]\n"
                           "SwitchName=leaf2 Level=0 LinkSpeed=1 Nodes=node[2,4]\n"
                           "SwitchName=spine Level=1 LinkSpeed=1 Nodes=node[1-4] Switches=leaf[1-2]\n")
    for t in (conf, shown):
        assert t.levels == 2 and t.leaf["node3"] == "leaf1" and t.parent["leaf2"] == "spine"
        assert t.ancestors("node4") == ["leaf2", "spine"]
    blocks = parse_topology("BlockName=b1 Nodes=gb[1-18]\nBlockName=b2 Nodes=gb[19-36]\nBlockSizes=18\n")
    assert blocks.block["gb19"] == "b2" and blocks.levels == 0


def test_chunks_stay_whole_in_uneven_leaves_and_spares_come_from_the_tightest_subtree():
    leaves = [[f"a{i}" for i in range(6)], [f"b{i}" for i in range(6)], [f"c{i}" for i in range(4)]]
    topo = parse_topology(tree_conf(leaves))
    hosts = [h for leaf in leaves for h in leaf]
    random.Random(0).shuffle(hosts)
    mapped = assign(topo, hosts, chunk=4)
    chunks = [mapped[i:i + 4] for i in range(0, 16, 4)]
    assert sum(len({topo.leaf[h] for h in c}) == 1 for c in chunks) == 3  # 6 + 6 + 4 hold three whole fours
    assert set(choose(topo, hosts, 4)) == set(leaves[2])  # the leaf that fits them exactly
    assert {topo.leaf[h] for h in choose(topo, hosts, 5)} in ({"leaf0"}, {"leaf1"})


def test_dry_planning_maps_the_groups_under_one_leaf_and_reports_a_scattered_allocation(tmp_path):
    conf = tmp_path / "topology.conf"
    conf.write_text(TWO_LEAVES)
    r = run_cli([*TINY, "cluster.nodes=4", "layout.pp=2", "layout.dp=2", "layout.order=pp-dp",
                 f"cluster.topology={conf}", "cluster.nodelist='node[1-4]'"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    pl = json.loads((tmp_path / "run" / "plan.json").read_text())["placement"]
    assert pl["nodes"] == ["node1", "node3", "node2", "node4"]  # each pipeline under one leaf
    assert pl["tiers"]["pp"] == "leaf" and pl["tiers"]["dp"] == "spine" and not pl["warnings"]
    assert "logical node -> host: 0:node1, 1:node3" in (tmp_path / "run" / "plan.md").read_text()
    r = run_cli([*TINY, "cluster.nodes=2", "layout.pp=2", f"cluster.topology={conf}",
                 "cluster.nodelist='node[1-2]'"], tmp_path / "b")
    assert r.returncode == 0, r.stderr[-2000:]
    pl = json.loads((tmp_path / "b" / "run" / "plan.json").read_text())["placement"]
    assert pl["tiers"]["pp"] == "spine" and pl["ideal_tiers"]["pp"] == "leaf"
    assert pl["step_s"] > pl["ideal_step_s"]
    assert "more scattered than the plan assumed: pp spans spine (plan: leaf)" in r.stdout


def test_a_bad_nodelist_or_topology_is_rejected_naming_the_key(tmp_path):
    conf, broken = tmp_path / "topology.conf", tmp_path / "broken.conf"
    conf.write_text(TWO_LEAVES)
    broken.write_text("SwitchName=spine Switches=leaf[1-2]\n")
    for bad, key in (("cluster.nodelist='node[1-'", "cluster.nodelist"),
                     ("cluster.nodelist=node1", "cluster.nodelist, cluster.nodes")):
        plan = plan_of(*TINY, "cluster.nodes=2", "layout.dp=2", f"cluster.topology={conf}", bad)
        assert not plan.valid and [e.key for e in plan.errors] == [key]
    r = run_cli([*TINY, "cluster.nodes=2", "layout.dp=2", f"cluster.topology={broken}"], tmp_path)
    assert r.returncode == 2 and "[cluster.topology]" in r.stderr + r.stdout and "Traceback" not in r.stderr
    assert "'leaf1', which is not defined" in r.stderr + r.stdout


def test_topology_aware_mapping_keeps_pipelines_off_the_oversubscribed_tier():
    """256 nodes over 16 leaves of 16 in random name order, one pod above them (llama3_meta's
    tiers by level: rack, pod): every PP16 group lands under one leaf, where the name-order
    mapping spreads each over the pod, and the step re-costed on the achieved tiers is faster."""
    plan = plan_of("hardware=h100_sxm", "model=llama3_8b", "fabric=llama3_meta", "cluster.nodes=256",
                   "layout.tp=8", "layout.pp=16", "layout.dp=16", "layout.order=tp-cp-pp-dp", "training.seq_len=8192",
                   "training.global_batch=512", "figures=false")
    assert plan.valid, plan.errors
    names = [f"n{i:04d}" for i in range(256)]
    shuffled = random.Random(1).sample(names, 256)
    topo = parse_topology(tree_conf([shuffled[i:i + 16] for i in range(0, 256, 16)], per_pod=16))
    pl = place(plan, names, topo)
    for k in range(0, 256, 16):
        assert len({topo.leaf[h] for h in pl.nodes[k:k + 16]}) == 1
    assert pl.tiers == {"tp": "nvlink", "pp": "rack", "dp": "pod"} and not pl.warnings
    named = achieved_tiers(plan, topo, names)
    assert named["pp"].name == "pod" and pl.step_s < pl.name_order_step_s


def test_sbatch_asks_for_a_compact_allocation_golden(tmp_path):
    """launcher.switches=N@max-wait reaches the batch script as --switches (golden); a value
    that is not N[@max-wait] is rejected naming the key, before anything is written."""
    from conftest import golden, sbatch_text

    text = sbatch_text(["hardware=cpu", "model=tiny", "cluster.nodes=2", "hardware.gpus_per_node=4",
                        "launcher=slurm", "launcher.partition=gpu", "launcher.switches='2@1-00:30:00'"],
                       tmp_path / "jobs")
    assert "#SBATCH --switches=2@1-00:30:00\n" in text and text == golden("sbatch_switches.txt", text)
    seg = sbatch_text(["hardware=cpu", "model=tiny", "cluster.nodes=4", "launcher=slurm", "launcher.segment=2"],
                      tmp_path / "seg")
    assert "#SBATCH --segment=2\n" in seg
    r = run_cli(["hardware=cpu", "model=tiny", "launcher=slurm", "launcher.switches=0", "launcher.segment=0"], tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "[launcher.switches]" in r.stderr and "[launcher.segment]" in r.stderr
    assert not (tmp_path / "run" / "slurm").exists()


def test_a_topology_shaped_like_the_fabric_preset_reproduces_the_plans_own_step():
    """Llama 3 405B on 1,024 nodes, llama3_meta: racks of 2 nodes, pods of 384 nodes, 1:7 above.
    Hosts under exactly those switches give back the plan's tiers and its step to the last
    digit; the same hosts with names dealt at random, mapped in name order, put PP across the
    oversubscribed tier with few members per pod and cost more; mapped by topology, they do not."""
    plan = plan_of("recipe=llama3_405b", "figures=false")
    names = [f"n{i:04d}" for i in range(1024)]
    racks = [names[i:i + 2] for i in range(0, 1024, 2)]
    pl = place(plan, names, parse_topology(tree_conf(racks, per_pod=192)))
    assert pl.nodes == names and pl.tiers == pl.ideal and pl.step_s == pytest.approx(plan.step.wall_s, rel=1e-12)
    dealt = random.Random(0).sample(names, 1024)
    pl = place(plan, names, parse_topology(tree_conf([dealt[i:i + 2] for i in range(0, 1024, 2)], per_pod=192)))
    assert pl.step_s == pytest.approx(plan.step.wall_s, rel=1e-12)
    assert pl.tiers["pp"] == "pod" and pl.name_order_step_s > 1.02 * plan.step.wall_s


def test_each_attempt_places_the_survivors_again_and_takes_the_spare_under_the_same_leaf(tmp_path):
    """What the SLURM job does before each attempt (launch/hosts.py): of the nodes in service
    (node4 lost: node1, node2, node3) the 2-node plan takes the two under one leaf, and the
    attempt's plan.json and plan.md say so (once, however often it is placed)."""
    from orchestrator import compose
    from orchestrator.config.compose import typed
    from orchestrator.launch.hosts import for_attempt
    from orchestrator.report.artifacts import write_plan

    conf = tmp_path / "topology.conf"
    conf.write_text(TWO_LEAVES)
    write_plan(plan_of(*TINY, "cluster.nodes=2", "layout.pp=2"), tmp_path / "run", figures=False)
    spec = typed(compose([*TINY, "cluster.nodes=2", "layout.pp=2", f"cluster.topology={conf}"]))
    said = []
    for _ in range(2):
        hosts = for_attempt(spec, tmp_path / "run", ["node1", "node2", "node3"], 2, say=said.append)
        assert hosts == ["node1", "node3"]
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["placement"]["nodes"] == hosts and plan["placement"]["tiers"] == {"pp": "leaf"}
    assert (tmp_path / "run" / "plan.md").read_text().count("## Placement on the allocation") == 1
    assert any("logical node -> host: 0:node1, 1:node3" in line for line in said)


def test_tensor_parallel_groups_stay_inside_an_nvlink_block():
    """GB200 NVL72 (4-GPU trays, fabric nvl72) with SLURM's topology/block: two blocks of 18
    trays whose names alternate. TP8 spans two trays; mapped by blocks every TP group stays on
    NVLink and the step is the plan's own; in name order TP crosses the network."""
    plan = plan_of("hardware=gb200", "fabric=nvl72", "model=llama3_70b", "cluster.nodes=36", "layout.tp=8",
                   "layout.pp=2", "layout.dp=9", "training.seq_len=8192", "training.global_batch=72", "figures=false")
    names = [f"gb{i}" for i in range(1, 37)]
    topo = parse_topology(f"BlockName=b1 Nodes={','.join(names[0::2])}\nBlockName=b2 Nodes={','.join(names[1::2])}\n"
                          "BlockSizes=18\n")
    pl = place(plan, names, topo)
    assert pl.tiers["tp"] == "nvlink" and pl.step_s == pytest.approx(plan.step.wall_s, rel=1e-12)
    assert all(topo.block[pl.nodes[k]] == topo.block[pl.nodes[k + 1]] for k in range(0, 36, 2))
    assert achieved_tiers(plan, topo, names)["tp"].name == "network" and pl.name_order_step_s > 2 * pl.step_s


def test_without_a_topology_the_hosts_keep_their_order_and_the_plan_its_tiers():
    plan = plan_of(*TINY, "cluster.nodes=2", "layout.pp=2")
    pl = place(plan, ["node9", "node2", "node5"], None)
    assert pl.nodes == ["node9", "node2"] and pl.tiers == pl.ideal == {"pp": plan.axes["pp"].tier}
    assert pl.step_s == plan.step.wall_s and not pl.warnings
