"""Rank placement (issue: place ranks by topology): groups, tiers, order, pictures, mesh."""
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import plan_of
from orchestrator.report.figures import draw_cluster, draw_step_budget
from orchestrator.plan.topology import ORDER_AXES, RankGrid, parse_order


@settings(max_examples=200, deadline=None)
@given(sizes=st.fixed_dictionaries({a: st.sampled_from([1, 2, 3, 4, 8]) for a in ORDER_AXES}),
       order=st.permutations(list(ORDER_AXES)))
def test_groups_partition_the_ranks_and_coordinates_round_trip(sizes, order):
    g = RankGrid(sizes, order)
    assert g.world == int(np.prod(list(sizes.values())))
    for axis in ORDER_AXES:
        groups = g.groups(axis)
        assert groups.shape == (g.world // sizes[axis], sizes[axis])
        assert sorted(groups.ravel().tolist()) == list(range(g.world))  # a partition
        for members in groups[:5]:
            coords = [g.coords(int(r)) for r in members]
            # members differ only on this axis, and cover all its values
            assert sorted(c[axis] for c in coords) == list(range(sizes[axis]))
            others = {tuple(v for k, v in c.items() if k != axis) for c in coords}
            assert len(others) == 1
    for r in range(0, g.world, max(1, g.world // 17)):
        assert g.rank(g.coords(r)) == r


@settings(max_examples=100, deadline=None)
@given(tp=st.sampled_from([1, 2, 4, 8]), gpn=st.sampled_from([8, 16]), cp=st.sampled_from([1, 2]),
       pp=st.sampled_from([1, 2, 4]), dp=st.sampled_from([1, 2, 3]), rest=st.permutations(["cp", "ep", "dp", "pp"]))
def test_tp_within_a_node_when_innermost_and_it_fits(tp, gpn, cp, pp, dp, rest):
    g = RankGrid({"tp": tp, "cp": cp, "pp": pp, "dp": dp}, ["tp", *rest])
    if g.world % gpn:
        return
    assert not g.straddling("tp", gpn).any()


def test_megatron_string_order_is_accepted():
    assert parse_order("tp-cp-ep-dp-pp") == ["tp", "cp", "ep", "dp", "pp"]
    assert parse_order(["tp", "cp", "pp", "dp"]) == ["tp", "cp", "pp", "dp", "ep"]
    assert parse_order("auto") is None


LLAMA70B_512 = ["hardware=h100_sxm", "model=llama3_70b", "cluster.nodes=64", "training.seq_len=8192",
         "training.global_batch=2048", "cost.attention_flops=false"]


def test_512_gpus_tp8_every_node_is_one_tp_group():
    plan = plan_of(*LLAMA70B_512, "layout.tp=8")
    g = plan.grid()
    groups = g.groups("tp")
    assert groups.shape == (64, 8)
    assert all(set(row // 8) == {row[0] // 8} for row in groups)
    assert sorted(row[0] // 8 for row in groups) == list(range(64))
    assert plan.axes["tp"].tier == "nvlink" and plan.axes["tp"].straddling_groups == 0


def test_512_gpus_tp16_every_group_straddles_two_nodes_and_tp_moves_to_the_network():
    tp8 = plan_of(*LLAMA70B_512, "layout.tp=8")
    tp16 = plan_of(*LLAMA70B_512, "layout.tp=16", "layout.allow_cross_node_tp=true")
    groups = tp16.grid().groups("tp")
    assert all(len(set(row // 8)) == 2 for row in groups)
    assert tp16.axes["tp"].straddling_groups == 32
    assert tp16.axes["tp"].gbps == 50.0
    assert tp16.step.tp > 5 * tp8.step.tp  # the seed's cliff


def test_auto_order_reproduces_meta_and_dp_crosses_pods():
    plan = plan_of("recipe=llama3_405b")
    live = [a for a in plan.order if plan.grid().sizes[a] > 1]
    assert live == ["tp", "pp", "dp"]
    assert plan.order.index("tp") < plan.order.index("cp") < plan.order.index("pp") < plan.order.index("dp")
    tiers = {a: plan.axes[a].tier for a in ("tp", "pp", "dp")}
    assert tiers["tp"] == "nvlink" and tiers["pp"] in ("rack", "pod") and tiers["dp"] == "cluster"
    # long context: context parallelism goes right outside tensor parallelism
    lc = plan_of("recipe=llama3_405b_long_context")
    assert [a for a in lc.order if lc.grid().sizes[a] > 1] == ["tp", "cp", "pp", "dp"]


def test_dp_innermost_is_slower_and_the_report_says_why():
    good = plan_of("recipe=llama3_405b")
    bad = plan_of("recipe=llama3_405b", "layout.order=[dp,tp,cp,pp]", "layout.allow_cross_node_tp=true")
    assert bad.valid
    assert bad.step.total_s > 1.5 * good.step.total_s
    assert bad.axes["tp"].tier != "nvlink" and bad.axes["tp"].straddling_groups > 0
    assert any("straddle" in w and "layout.tp" in w for w in bad.warnings)
    rejected = plan_of("recipe=llama3_405b", "layout.order=[dp,tp,cp,pp]")
    assert not rejected.valid and any(e.key == "layout.tp" for e in rejected.errors)


def test_expert_parallel_goes_innermost_when_its_all_to_all_is_busiest():
    plan = plan_of("recipe=deepseek_v3")
    grid = plan.expert_grid()  # experts live in their own grid over the same ranks
    live = [a for a in grid.order if grid.sizes[a] > 1]
    assert live[0] == "ep"
    assert plan.axes["ep"].calls_per_step > plan.axes["pp"].calls_per_step > plan.axes["dp"].calls_per_step


def test_blast_radius_and_checkpoint_interval():
    plan = plan_of("recipe=llama3_405b")
    br = plan.blast_radius
    assert br["gpus_per_replica"] == 8 * 16 and br["replicas"] == 64
    assert br["replicas_lost_per_node_failure"] == 1
    # 419 interruptions in 54 days on 16,384 GPUs: about 3.1 h between interruptions at that scale
    assert plan.spec.hardware.failures_per_gpu_hour * 16384 * 54 * 24 == pytest.approx(419, rel=0.01)
    assert br["job_mtbf_hours"] == pytest.approx(1 / (1.97e-5 * 8192), rel=1e-6)
    expected = (2 * br["checkpoint_seconds"] * br["job_mtbf_hours"] * 3600) ** 0.5
    assert br["checkpoint_interval_s"] == pytest.approx(expected)
    # DP innermost: one node holds ranks of 8 replicas
    bad = plan_of("recipe=llama3_405b", "layout.order=[dp,tp,cp,pp]", "layout.allow_cross_node_tp=true")
    assert bad.blast_radius["replicas_lost_per_node_failure"] == 8


def _red_rows(fig):
    ax = fig.axes[0]
    rows = []
    for p in ax.patches:
        if tuple(np.round(p.get_edgecolor()[:3], 2)) == (1.0, 0.0, 0.0):
            rows.append(int(round(p.get_y() + 0.5)))
    return sorted(rows)


@pytest.mark.parametrize("tp,gpn,nodes", [(8, 8, 64), (16, 8, 64), (4, 6, 4), (2, 4, 3)])
def test_red_outlines_exactly_where_a_group_straddles_a_node(tp, gpn, nodes):
    plan = plan_of("hardware=cpu", "model=tiny", f"hardware.gpus_per_node={gpn}", f"cluster.nodes={nodes}",
                   f"layout.tp={tp if tp <= 8 else 8}", "layout.allow_cross_node_tp=true",
                   "training.global_batch=%d" % (gpn * nodes * 8), "training.seq_len=64")
    if tp == 16:
        plan = plan_of(*LLAMA70B_512, "layout.tp=16", "layout.allow_cross_node_tp=true")
    fig, data = draw_cluster(plan, "tp")
    g = plan.grid()
    gpn = plan.spec.hardware.gpus_per_node
    expected = sorted({int(n) for row in g.groups("tp") if len(set(row // gpn)) > 1 for n in set(row // gpn)
                       if n < data["nodes_shown"]})
    assert data["outlined_nodes"] == expected
    assert _red_rows(fig) == expected
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_figures_are_written_next_to_plan_json(cli):
    r = cli("recipe=llama3_405b")
    assert r.returncode == 0, r.stderr
    for name in ("cluster.png", "step_budget.png"):
        data = (cli.dir / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert json.loads((cli.dir / "plan.json").read_text())["valid"]


def test_step_budget_compares_layouts():
    plans = [plan_of(*LLAMA70B_512, f"layout.tp={t}", "layout.allow_cross_node_tp=true") for t in (4, 8, 16)]
    fig = draw_step_budget(plans)
    bars = fig.axes[0].patches
    assert len(bars) >= 3 * 2  # arithmetic and TP at least, one bar per layout
    import matplotlib.pyplot as plt

    plt.close(fig)


def _mesh_worker(rank, world, plans):
    import torch.distributed as dist

    from orchestrator.train.mesh import meshes_from_plan

    out = {}
    for name, plan_json in plans.items():
        mesh = meshes_from_plan(plan_json, "cpu")["dense"]
        out[name] = {dim: dist.get_process_group_ranks(mesh.get_group(dim)) for dim in ("tp", "pp", "dps")
                     if mesh[dim].size() > 1}
    import os

    with open(os.path.join(os.environ["MESH_OUT"], f"{rank}.json"), "w") as f:
        json.dump(out, f)


def test_device_mesh_from_the_grid_matches_the_plan_for_two_orders(tmp_path, monkeypatch):
    from dist_util import run_workers

    base = ["hardware=cpu", "model=tiny", "cluster.nodes=2", "hardware.gpus_per_node=4", "layout.tp=2",
            "layout.pp=2", "layout.dp=2", "training.global_batch=16", "training.seq_len=64"]
    plans = {}
    for name, order in (("meta", "[tp,cp,pp,dp]"), ("megatron", "tp-cp-ep-dp-pp")):
        p = plan_of(*base, f"layout.order={order}")
        assert p.valid, p.errors
        plans[name] = json.loads(json.dumps(p.to_json(), default=float))
    assert plans["meta"]["ranks"]["order"] != plans["megatron"]["ranks"]["order"]
    monkeypatch.setenv("MESH_OUT", str(tmp_path))
    run_workers(_mesh_worker, 8, plans)
    from orchestrator.train.mesh import grid_from_json

    for name, pj in plans.items():
        grid = grid_from_json(pj)
        for rank in range(8):
            got = json.loads((tmp_path / f"{rank}.json").read_text())[name]
            assert set(got) == {"tp", "pp", "dps"}
            for dim, ranks in got.items():
                assert sorted(ranks) == sorted(grid.group_of(rank, "dp" if dim == "dps" else dim)), (name, rank, dim)
    # the two orders really give different groups
    g1, g2 = grid_from_json(plans["meta"]), grid_from_json(plans["megatron"])
    assert g1.group_of(0, "pp") != g2.group_of(0, "pp")


# ---- the expert grid against Megatron-Core's RankGenerator (megatron/core/parallel_state.py) ----
MOE_TINY = ["hardware=cpu", "model=tiny", "model.moe.experts=8", "model.moe.experts_per_token=2",
            "model.moe.expert_ffn_hidden=64", "hardware.gpu_memory_gb=100", "training.global_batch=16"]


MEGATRON_CASES = [
    ("tp-cp-ep-dp-pp", 2, 2, 2, 4, 1),  # Megatron's default order; EP spans the dense tp x cp block
    ("tp-cp-ep-pp-dp", 2, 2, 2, 4, 1),  # --use-tp-pp-dp-mapping (edp = dp, so pp need not be last)
    ("tp-cp-ep-dp-pp", 2, 1, 2, 2, None),  # etp = tp: EP carves the dense dp axis
    ("tp-cp-ep-dp-pp", 1, 2, 1, 8, None),  # EP over dp x cp (DeepSeek-style), no pipeline
    ("ep-tp-dp-cp-pp", 2, 2, 2, 2, 2),  # any order initialize_model_parallel accepts
    ("tp-ep-cp-dp-pp", 4, 2, 1, 4, 2),
]


@pytest.fixture(scope="module")
def megatron_core_groups() -> dict:
    """Megatron-Core's own groups for MEGATRON_CASES on a world of 16, from one run of its
    initialize_model_parallel (tests/megatron_core.py): token -> groups, as the plan names them."""
    import megatron_core

    cases = [(16, dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
                       expert_model_parallel_size=ep, expert_tensor_parallel_size=etp, order=order))
             for order, tp, cp, pp, ep, etp in MEGATRON_CASES]
    out = {}
    for case, made in zip(MEGATRON_CASES, megatron_core.groups(cases)):
        assert "refused" not in made, (case, made)
        out[case] = {**{("dense", t): made[d] for t, d in megatron_core.DENSE.items()},
                     **{("expert", t): made[d] for t, d in megatron_core.EXPERT.items()},
                     ("expert", "pp"): made["PIPELINE_MODEL_PARALLEL_GROUP"]}
    return out


def _plan_groups(plan) -> dict:
    dense, expert = plan.grid(), plan.expert_grid()
    out = {}
    for (grid_name, grid) in (("dense", dense), ("expert", expert)):
        for token in (("tp", "cp", "dp", "pp", "dp-cp") if grid_name == "dense" else
                      ("ep", "etp", "edp", "pp", "etp-ep", "etp-ep-pp")):
            out[(grid_name, token)] = grid.groups(token.split("-")).tolist()
    return out


def _same(a: list[list[int]], b: list[list[int]]) -> bool:
    return sorted(map(sorted, a)) == sorted(map(sorted, b))


@pytest.mark.parametrize("order,tp,cp,pp,ep,etp", MEGATRON_CASES)
def test_expert_and_dense_groups_match_megatron_core(order, tp, cp, pp, ep, etp, megatron_core_groups):
    world = 16
    overrides = [*MOE_TINY, "cluster.nodes=4", f"layout.tp={tp}", f"layout.cp={cp}", f"layout.pp={pp}",
                 f"layout.ep={ep}", f"layout.order={order}", "layout.allow_cross_node_tp=true"]
    # None: Megatron's default etp (tp), which this runtime's stack does not share (it defaults to 1)
    overrides.append(f"layout.etp={tp if etp is None else etp}")
    plan = plan_of(*overrides)
    assert plan.valid, [str(e) for e in plan.errors]
    want = megatron_core_groups[(order, tp, cp, pp, ep, etp)]
    got = _plan_groups(plan)
    for key, groups in want.items():
        assert _same(got[key], groups), (key, got[key], groups)
        if "-" not in key[1]:  # one axis: the same groups in the same order, members in the same order
            assert got[key] == groups, (key, got[key], groups)
    # and the plan reports a tier for each live expert axis
    assert all(plan.axes[a].tier for a in ("ep", "edp") if plan.axes[a].size > 1)
