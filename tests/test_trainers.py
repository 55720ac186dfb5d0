"""External trainers (trainer=torchtitan, megatron, command): config, refusals, the rendered
command lines, the framework's own rank groups against the plan's, and the example script
trained under trainer=command through a node loss."""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest

import megatron_core
from conftest import ROOT, failovers, golden, losses_by_step, plan_of


SMALL = ["hardware=h100_sxm", "model=llama3_8b", "cluster.nodes=4", "training.global_batch=64", "launcher=slurm"]


def flags(args: list[str]) -> dict:
    out = {}
    for a in args:
        k, _, v = a.partition("=")
        out[k] = v
    return out


# ---- config ----------------------------------------------------------------------------
def test_a_framework_trainer_plans_on_its_own_stack_unless_stack_is_given():
    from orchestrator import compose
    from orchestrator.config.compose import typed

    assert typed(compose(["recipe=llama3_405b", "trainer=torchtitan"])).stack.name == "torchtitan"
    assert typed(compose(["recipe=llama3_405b", "trainer=megatron"])).stack.name == "megatron_core"
    assert typed(compose(["recipe=llama3_405b"])).stack.name == "llama3_meta"  # the recipe's, without a trainer
    assert typed(compose(["trainer=torchtitan", "stack=megatron_core"])).stack.name == "megatron_core"
    for t in ("torchtitan", "megatron"):
        p = plan_of("recipe=llama3_405b", f"trainer={t}", "launcher=slurm")
        assert p.valid, p.errors


def test_mismatches_and_unsafe_commands_are_refused_with_the_key():
    p = plan_of("trainer=torchtitan", "stack=megatron_core", "launcher=local", "hardware=cpu", "model=tiny")
    assert p.errors[0].key == "stack, trainer" and "trainer=command" in p.errors[0].fix
    p = plan_of("stack=torchtitan", "launcher=local", "hardware=cpu", "model=tiny")
    assert p.errors[0].key == "stack" and "trainer=torchtitan" in p.errors[0].fix
    p = plan_of("trainer=command", "launcher=local", "hardware=cpu", "model=tiny")
    assert [e.key for e in p.errors] == ["trainer.command"]
    for bad, why in (("python t.py\n--x", "control character"), ("python 't.py", "shell words"),
                     ("python t.py \x1b[2J", "control character")):
        quoted = bad.replace("'", "\\'")
        p = plan_of("trainer=command", f"trainer.command='{quoted}'", "launcher=local", "hardware=cpu", "model=tiny")
        assert [e.key for e in p.errors] == ["trainer.command"] and why in p.errors[0].message, p.errors
    p = plan_of("trainer=command", "trainer.command='python t.py'", "launcher=local", "hardware=cpu", "model=tiny",
                "stack=megatron_core")
    assert p.valid, p.errors  # your own program may be priced as any stack


def test_what_the_framework_cannot_run_is_refused_before_launch():
    p = plan_of(*SMALL, "trainer=torchtitan", "layout.pp=2", "schedule=zero_bubble", "layout.tp=2")
    assert [e.key for e in p.errors] == ["schedule.name"] and "dualpipev" in p.errors[0].fix
    p = plan_of(*SMALL, "trainer=megatron", "layout.pp=4", "schedule=dualpipev", "layout.tp=2")
    assert [e.key for e in p.errors] == ["schedule.name"], p.errors
    p = plan_of(*SMALL, "trainer=torchtitan", "layout.zero=1", "layout.tp=2")
    assert [e.key for e in p.errors] == ["layout.zero"]
    assert plan_of(*SMALL, "trainer=torchtitan", "layout.pp=2", "schedule=dualpipev", "layout.tp=2").valid
    for trainer in ("torchtitan", "megatron"):  # both save to a file system path, not an object store
        p = plan_of(*SMALL, f"trainer={trainer}", "layout.tp=2", "training.checkpoint.dir=s3://bucket/run")
        assert [e.key for e in p.errors] == ["training.checkpoint.dir"] and "s3://bucket/run" in p.errors[0].message


# ---- rendered arguments ------------------------------------------------------------------
def _preview(cli, trainer: str) -> str:
    r = cli("recipe=llama3_405b", f"trainer={trainer}", "launcher=slurm", "launcher.submit=false", "figures=false",
            "training.checkpoint.every=500")
    assert r.returncode == 0, r.stderr[-3000:]
    srun = (cli.dir / "slurm" / "preview.srun").read_text()
    assert srun.strip() in r.stdout  # shown, not only written
    assert "--nodelist=<node[1-1024]> " in srun  # 1,024 nodes as SLURM writes a host list
    env = r.stdout.split("each rank's environment", 1)[1]
    for shown in ("MASTER_ADDR=<node1>", "WORLD_SIZE=8192", "LOCAL_WORLD_SIZE=8", "LOCAL_RANK=$SLURM_LOCALID",
                  f"ORCH_PLAN={cli.dir}/plan.json", "RANK=the rank placed on GPU SLURM_NODEID x 8 + SLURM_LOCALID"):
        assert shown in env, (shown, env)
    if trainer == "megatron":  # Megatron-FSDP: the variable Megatron refuses at 1 is taken out
        assert "CUDA_DEVICE_MAX_CONNECTIONS removed (unset)" in env
    else:
        assert "CUDA_DEVICE_MAX_CONNECTIONS" not in env
    return srun.split(" -- ", 1)[1].replace(str(cli.dir), "RUN")


@pytest.mark.parametrize("trainer", ["torchtitan", "megatron"])
def test_slurm_preview_shows_the_framework_command_line_rendered_from_the_plan(cli, trainer):
    line = _preview(cli, trainer)
    assert line == golden(f"trainer_{trainer}.txt", line)
    f = flags(line.split())
    if trainer == "torchtitan":  # TP8 PP16 DP64 interleaved over 7 chunks, the recipe's uneven split
        assert f["--parallelism.tensor_parallel_degree"] == "8" and f["--parallelism.pipeline_parallel_degree"] == "16"
        assert f["--parallelism.data_parallel_shard_degree"] == "64"
        assert f["--training.local_batch_size"] == str(2048 // 64)
        toml = (cli.dir / "torchtitan.toml").read_text()
        parts = re.findall(r"\[([^\[\]]*)\]", toml.split("=", 1)[1])
        assert len(parts) == 16 * 7 and parts[0].startswith('"tok_embeddings", "layers.0"')
        assert sum(p.count("layers.") for p in parts) == 126
    else:
        assert f["--tensor-model-parallel-size"] == "8" and f["--pipeline-model-parallel-size"] == "16"
        assert f["--global-batch-size"] == "2048" and f["--num-layers"] == "126"
        # Megatron's parse_str_to_list (megatron/core/transformer/pipeline_parallel_layer_layout.py:283-320)
        text = f["--pipeline-model-parallel-layout"].replace(",", "")
        for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
            text = re.sub(pattern, lambda x: x.group(1) * int(x.group(2)), text)
        stages = text.split("|")
        plan = plan_of("recipe=llama3_405b", "trainer=megatron", "launcher=slurm").layout
        assert [s.count("t") for s in stages] == [b - a for a, b in plan.virtual_stages()]
        assert stages[0].startswith("E") and stages[-1].endswith("L")


def test_megatron_names_are_cited_and_match_its_source():
    from orchestrator.frameworks import megatron, trainers

    rendered = set()
    for case in ([*SMALL, "layout.tp=2"], [*SMALL, "layout.tp=2", "model=tiny_moe", "layout.ep=4", "layout.zero=1",
                                           "training.recompute=full", "training.recompute_layers=2", "layout.pp=2"],
                 [*SMALL, "layout.zero=3"], ["recipe=deepseek_v3", "schedule=1f1b", "launcher=slurm"]):
        p = plan_of(*case, "trainer=megatron", "training.checkpoint.every=10")
        assert p.valid, p.errors
        rendered |= {a.split("=")[0] for a in trainers.argv(p.to_json(), Path("/RUN")) if a.startswith("--")}
    assert rendered <= set(megatron.CITED), rendered - set(megatron.CITED)
    assert {"--multi-latent-attention", "--moe-router-num-groups", "--mtp-num-layers", "--ckpt-format"} <= rendered
    root = os.environ.get("MEGATRON_LM")
    if not root:
        pytest.skip(f"set MEGATRON_LM to a Megatron-LM checkout at {megatron.COMMIT[:10]} to check the citations")
    import megatron_names

    found = megatron_names.names(Path(root))
    assert {k: found.get(k) for k in megatron.CITED} == megatron.CITED


def test_torchtitan_names_match_its_config_classes():
    from orchestrator.frameworks import torchtitan, trainers

    spec = importlib.util.find_spec("torchtitan")
    if spec is None:
        pytest.skip(f"torchtitan is not installed (checked against torchtitan=={torchtitan.VERSION}: "
                    f"pip install --no-deps torchtitan=={torchtitan.VERSION})")
    path = Path(spec.submodule_search_locations[0]) / "config" / "job_config.py"
    mod_spec = importlib.util.spec_from_file_location("tt_job_config", path)  # dataclasses only: no torch
    jc = importlib.util.module_from_spec(mod_spec)
    sys.modules["tt_job_config"] = jc
    mod_spec.loader.exec_module(jc)
    sections = {f.name: f.default_factory() for f in dataclasses.fields(jc.JobConfig)}
    base = [*SMALL, "layout.tp=2"]
    for case in (base, [*base, "layout.pp=2", "schedule=dualpipev", "training.recompute=selective"],
                 ["recipe=llama3_405b", "launcher=slurm"], [*base, "model=tiny_moe", "layout.ep=4"]):
        p = plan_of(*case, "trainer=torchtitan", "training.checkpoint.every=10")
        assert p.valid, p.errors
        for a in trainers.argv(p.to_json(), Path("/RUN")):
            if not a.startswith("--"):
                continue
            key, _, value = a[2:].partition("=")
            section, field = key.split(".")
            obj = sections[section]
            assert hasattr(obj, field), a
            default = getattr(obj, field)
            if isinstance(default, bool):
                assert value == "", a  # booleans are bare flags
            elif isinstance(default, int):
                int(value)
            hint = {f.name: f.type for f in dataclasses.fields(obj)}[field]
            if "Literal" in str(hint):
                assert repr(value) in str(hint), (a, hint)


# ---- placement: the framework's own groups, built from RANK as the framework builds them ---
def _plan_groups(pj: dict, members) -> set:
    from orchestrator.plan.topology import RankGrid

    g = RankGrid(pj["ranks"]["sizes"], pj["ranks"]["order"])
    key = lambda p: tuple(v for a, v in sorted(members(g.coords(p)).items()))  # noqa: E731
    out: dict = {}
    for p in range(g.world):
        out.setdefault(key(p), set()).add(p)
    return {frozenset(v) for v in out.values()}


def _groups_along(cube: np.ndarray, axes: tuple[int, ...]) -> list[list[int]]:
    rest = [i for i in range(cube.ndim) if i not in axes]
    return np.transpose(cube, rest + list(axes)).reshape(-1, int(np.prod([cube.shape[a] for a in axes]))).tolist()


def _check(pj: dict, fw_groups: dict, gpn: int) -> None:
    """Every framework group (of RANKs) maps onto the positions of one plan group; TP on one node."""
    from orchestrator.frameworks.trainers import rank_map

    ranks = rank_map(pj)
    assert sorted(ranks) == list(range(len(ranks)))
    pos = {r: p for p, r in enumerate(ranks)}
    shard = pj["layout"]["dp_shard"] if pj["layout"]["zero"] else 1
    plan = {"tp": lambda c: {k: c[k] for k in c if k != "tp"}, "cp": lambda c: {k: c[k] for k in c if k != "cp"},
            "pp": lambda c: {k: c[k] for k in c if k != "pp"}, "dp": lambda c: {k: c[k] for k in c if k != "dp"},
            "dps": lambda c: {**{k: c[k] for k in c if k != "dp"}, "r": c["dp"] // shard},
            "dpr": lambda c: {**{k: c[k] for k in c if k != "dp"}, "s": c["dp"] % shard}}
    for axis, groups in fw_groups.items():
        mine = {frozenset(pos[r] for r in g) for g in groups}
        assert mine == _plan_groups(pj, plan[axis]), axis
    for g in fw_groups["tp"]:
        assert len({pos[r] // gpn for r in g}) == 1, g


MOE = [["model=tiny_moe", "layout.ep=4", "layout.tp=2"], ["model=tiny_moe", "layout.ep=2", "layout.tp=2", "layout.pp=2"]]
LAYOUTS = [["layout.tp=2", "layout.pp=2"], ["layout.tp=2", "layout.pp=2", "layout.order=[tp,dp,pp]"],
           ["layout.tp=4", "layout.pp=2", "layout.order=tp-pp-dp"], ["layout.tp=2", "layout.cp=2", "layout.pp=2"],
           ["layout.tp=2", "layout.dp_shard=4", "layout.pp=2"], ["layout.tp=8"], ["layout.pp=4", "layout.tp=2"]]


@pytest.mark.parametrize("extra", LAYOUTS + MOE, ids=lambda e: " ".join(e))
def test_torchtitan_groups_from_rank_are_the_plans(extra):
    """torchtitan (pd.py _build_mesh_without_ep) calls init_device_mesh over the dims pp,
    dp_replicate, dp_shard, cp, tp; torch lays RANKs out as arange(world).view(dims)
    (torch/distributed/device_mesh.py, init_device_mesh)."""
    from orchestrator.frameworks.trainers import argv

    p = plan_of(*SMALL, "trainer=torchtitan", *extra)
    assert p.valid, p.errors
    pj = p.to_json()
    f = flags(argv(pj, Path("/RUN")))
    dims = [int(f[f"--parallelism.{k}"]) for k in ("pipeline_parallel_degree", "data_parallel_replicate_degree",
                                                    "data_parallel_shard_degree", "context_parallel_degree",
                                                    "tensor_parallel_degree")]
    cube = np.arange(int(np.prod(dims))).reshape(dims)
    _check(pj, {"pp": _groups_along(cube, (0,)), "dpr": _groups_along(cube, (1,)), "dps": _groups_along(cube, (2,)),
                "dp": _groups_along(cube, (1, 2)), "cp": _groups_along(cube, (3,)), "tp": _groups_along(cube, (4,))},
           p.spec.hardware.gpus_per_node)
    ep = int(f["--parallelism.expert_parallel_degree"])
    if ep > 1:  # pd.py _build_mesh_with_ep (etp=1): dp_shard = mod_ep x in_ep, ep = flatten(in_ep, cp, tp)
        pp_, dpr, dps, cp, tp = dims
        inner = ep // (cp * tp)
        cube = np.arange(int(np.prod(dims))).reshape(pp_, dpr, dps // inner, inner, cp, tp)
        from orchestrator.frameworks.trainers import rank_map

        pos = {r: q for q, r in enumerate(rank_map(pj))}
        mine = {frozenset(pos[r] for r in g) for g in _groups_along(cube, (3, 4, 5))}
        assert mine == {frozenset(g) for g in p.expert_grid().groups("ep").tolist()}


MEGATRON = LAYOUTS[:4] + [["layout.tp=2", "layout.dp_shard=2", "layout.zero=1"],
                          ["model=tiny_moe", "layout.ep=4", "layout.tp=2", "layout.pp=2", "layout.zero=1"]]
EXPERT_ORDERS = [["layout.ep=4", "layout.tp=2"], ["layout.ep=2", "layout.tp=2", "layout.pp=2"],
                 ["layout.ep=4", "layout.tp=2", "layout.order=[ep,tp,cp,dp,pp]"],
                 ["layout.ep=8", "layout.tp=2", "layout.order=[tp,dp,ep,pp]"]]


@pytest.fixture(scope="module")
def megatron_groups() -> dict:
    """Every Megatron plan of this file -> (plan, Megatron-Core's groups of RANKs), from one run of
    megatron-core's own initialize_model_parallel (tests/megatron_core.py) on the rendered sizes and
    the order Megatron-LM passes it ('tp-cp-ep-pp-dp' with --use-tp-pp-dp-mapping, initialize.py:395)."""
    from orchestrator.frameworks.trainers import argv

    keys = [tuple(e) for e in MEGATRON] + [("model=tiny_moe", *e) for e in EXPERT_ORDERS]
    plans, cases = [], []
    for key in keys:
        p = plan_of(*SMALL, "trainer=megatron", *key)
        assert p.valid, (key, p.errors)
        f = flags(argv(p.to_json(), Path("/RUN")))
        plans.append(p)
        cases.append((p.world_size, megatron_core.kwargs_of(f, "tp-cp-ep-pp-dp" if "--use-tp-pp-dp-mapping" in f
                                                            else "tp-cp-ep-dp-pp")))
    return dict(zip(keys, zip(plans, megatron_core.groups(cases))))


@pytest.mark.parametrize("extra", MEGATRON, ids=lambda e: " ".join(e))
def test_megatron_cores_own_groups_from_rank_are_the_plans(extra, megatron_groups):
    """Megatron-Core's tensor, context, data (and, with copies of the distributed optimizer, the
    shard), pipeline and expert groups, built by its own code from the RANK each GPU is given,
    are the plan's groups on the plan's GPUs."""
    from orchestrator.frameworks.trainers import rank_map

    p, g = megatron_groups[tuple(extra)]
    assert "refused" not in g, g
    pj = p.to_json()
    ours = {a: g[megatron_core.DENSE[a]] for a in ("tp", "cp", "dp", "pp")}
    if pj["layout"]["dp_replicate"] > 1:  # --num-distributed-optimizer-instances: the shard group inside a copy
        ours["dps"] = g["INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP"]
    _check(pj, ours, p.spec.hardware.gpus_per_node)
    if p.layout.ep > 1:
        pos = {r: q for q, r in enumerate(rank_map(pj))}
        for axis in ("ep", "etp", "edp"):
            theirs = {frozenset(pos[r] for r in grp) for grp in g[megatron_core.EXPERT[axis]]}
            assert theirs == {frozenset(x) for x in p.expert_grid().groups(axis).tolist()}, axis


# ---- the example under trainer=command, through a node loss ---------------------------------
def _uninterrupted(plan_json: dict, steps: int, lr: float) -> list[float]:
    """One process, no torch.distributed: the example's model and data, the whole global batch."""
    import torch

    spec = importlib.util.spec_from_file_location("train_fsdp", ROOT / "examples" / "train_fsdp.py")
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    cfg = plan_json["config"]
    model = ex.model_for(cfg)
    vocab = model[0].num_embeddings
    opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=1e-6)
    out = []
    for step in range(steps):
        tokens = ex.batch(step, cfg, vocab)
        loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(float(loss.detach()))
    return out


def test_the_example_trains_under_trainer_command_through_a_node_loss(cli):
    import json

    steps = 10
    r = cli("hardware=cpu", "cluster.nodes=2", "hardware.gpus_per_node=2", "model=tiny", f"training.steps={steps}",
            "training.global_batch=8", "training.checkpoint.every=2", "launcher=local", "figures=false",
            "trainer=command", "trainer.command='python examples/train_fsdp.py --lr 1e-2'",
            "fault.kill_node=1", "fault.at_step=5", timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run = cli.dir
    (event,) = failovers(run)
    assert event["mode"] == "restart" and event["new_layout"]["dp"] == 2 and event["resumed_from_step"] == 4
    assert "built-in runtime" in event["why_not_in_place"]
    assert "resumed from step 4" in (run / "attempt1" / "logs" / "rank0.log").read_text()
    attempts = [json.loads(x)["attempt"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert set(attempts) == {0, 1}
    ref = _uninterrupted(json.loads((run / "plan.json").read_text()), steps, 1e-2)
    got = losses_by_step(run)
    assert sorted(got) == list(range(steps))
    assert np.allclose([got[s] for s in range(steps)], ref, rtol=2e-5, atol=0), (got, ref)
    assert ref[-1] < ref[0] - 0.1  # it learns


# ---- failover and srun: arguments rendered again, torchrun's environment from SLURM's -------
@pytest.mark.parametrize("trainer,dp_flag", [("torchtitan", "--parallelism.data_parallel_shard_degree"),
                                             ("megatron", None)])
def test_after_a_node_loss_the_arguments_are_rendered_for_the_survivors(trainer, dp_flag):
    from orchestrator.plan.replan import replan_on_survivors
    from orchestrator.frameworks.trainers import argv

    p = plan_of(*SMALL, f"trainer={trainer}", "layout.tp=8", "training.checkpoint.every=10")
    rp = replan_on_survivors(p, 3)
    assert rp.plan is not None and rp.plan.layout.dp < p.layout.dp
    before, after = flags(argv(p.to_json(), Path("/RUN"))), flags(argv(rp.plan.to_json(), Path("/RUN/attempt1")))
    if dp_flag:
        assert (before[dp_flag], after[dp_flag]) == (str(p.layout.dp), str(rp.plan.layout.dp))
        assert before["--checkpoint.folder"] == after["--checkpoint.folder"] == "/RUN/checkpoints"  # resumes its own
    else:  # Megatron derives dp from the world; the batch stays, the checkpoint is the same
        assert before["--global-batch-size"] == after["--global-batch-size"] == "64"
        assert before["--load"] == after["--load"] == "/RUN/checkpoints"


def test_an_srun_task_gets_torchruns_environment_and_its_placed_rank(tmp_path):
    import json
    import subprocess

    from orchestrator.frameworks.trainers import rank_map

    p = plan_of(*SMALL, "trainer=torchtitan", "layout.tp=2", "layout.pp=2", "layout.order=[tp,pp,dp]")
    pj = p.to_json()
    (tmp_path / "plan.json").write_text(json.dumps(pj))
    ranks = rank_map(pj)
    assert ranks != sorted(ranks)  # torchtitan's pp is outermost, the plan's inside dp
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ORCH_PLAN", "ORCH_RUN_DIR"]
    show = f"import os, json; print(json.dumps({{k: os.environ.get(k) for k in {keys!r}}}))"
    for pos in (9, 31):
        env = dict(os.environ, SLURM_PROCID=str(pos), SLURM_NTASKS="32", SLURM_NNODES="4", SLURM_NODEID=str(pos // 8),
                   SLURM_LOCALID=str(pos % 8), ORCH_RUN_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
        r = subprocess.run([sys.executable, "-m", "orchestrator.launch.trainers", str(tmp_path), "--", "python", "-c",
                            show], capture_output=True, text=True, env=env, timeout=60, cwd=ROOT)
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout)
        assert got == {"RANK": str(ranks[pos]), "LOCAL_RANK": str(pos % 8), "WORLD_SIZE": "32", "LOCAL_WORLD_SIZE": "8",
                       "GROUP_RANK": str(pos // 8), "ORCH_PLAN": str(tmp_path / "plan.json"),
                       "ORCH_RUN_DIR": str(tmp_path)}


def _framework_expert_groups(p, trainer: str, request) -> set:
    """The framework's EP groups from RANK (torchtitan: pd.py _build_mesh_with_ep with etp=1;
    Megatron: megatron-core's own initialize_model_parallel), as positions on the plan's GPUs."""
    from orchestrator.frameworks.trainers import rank_map

    pj = p.to_json()
    lay = pj["layout"]
    pos = {r: q for q, r in enumerate(rank_map(pj))}
    if trainer == "megatron":
        key = next(k for k, (q, _) in request.getfixturevalue("megatron_groups").items() if q is p)
        groups = request.getfixturevalue("megatron_groups")[key][1][megatron_core.EXPERT["ep"]]
    else:
        tp, cp, ep, shard = lay["tp"], lay["cp"], lay["ep"], lay["dp_shard"]
        inner = ep // (cp * tp)
        cube = np.arange(p.world_size).reshape(lay["pp"], lay["dp_replicate"], shard // inner, inner, cp, tp)
        groups = _groups_along(cube, (3, 4, 5))
    return {frozenset(pos[r] for r in g) for g in groups}


@pytest.mark.parametrize("trainer", ["torchtitan", "megatron"])
def test_an_order_whose_expert_groups_the_framework_cannot_build_is_refused(trainer, cli, request):
    from orchestrator.frameworks.trainers import placement_problems

    seen = set()
    for extra in EXPERT_ORDERS:
        p = (request.getfixturevalue("megatron_groups")[("model=tiny_moe", *extra)][0] if trainer == "megatron"
             else plan_of(*SMALL, "model=tiny_moe", f"trainer={trainer}", *extra))
        assert p.valid, p.errors
        same = _framework_expert_groups(p, trainer, request) == {frozenset(g) for g in
                                                                 p.expert_grid().groups("ep").tolist()}
        assert bool(placement_problems(p)) == (not same), extra
        seen.add(same)
    assert seen == {True, False}
    r = cli(*SMALL, "model=tiny_moe", f"trainer={trainer}", "layout.ep=8", "layout.tp=2", "layout.order=[tp,dp,ep,pp]",
            "launcher.submit=false", "figures=false")
    assert r.returncode == 2 and "[layout.order, layout.ep]" in r.stderr and "Traceback" not in r.stderr, r.stderr


# ---- what Megatron-LM's validate_args ties to the rank's environment and to the flags ---------
ENV_KEYS = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "CUDA_DEVICE_MAX_CONNECTIONS"]
_SHOW = f"import os, json; print(json.dumps({{k: os.environ.get(k) for k in {ENV_KEYS!r}}}))"


@pytest.mark.parametrize("extra,connections", [
    (["layout.tp=2"], "1"),  # TP before Blackwell: 1 (arguments.py:1452-1479)
    (["layout.tp=1", "layout.cp=2", "training.seq_len=8192"], "1"),  # CP likewise
    (["layout.tp=2", "layout.zero=3"], None),  # Megatron-FSDP refuses 1 (arguments.py:1166): removed
    (["layout.tp=1"], "inherited"),  # nothing asked: the job's own value stays
])
def test_megatron_ranks_get_the_cuda_connections_megatron_validates_locally_and_under_srun(tmp_path, extra,
                                                                                         connections):
    import json
    import subprocess

    from orchestrator.launch.trainers import TrainerJob

    p = plan_of(*SMALL, "trainer=megatron", *extra)
    assert p.valid, p.errors
    pj = p.to_json()
    want = "inherited" if connections == "inherited" else connections
    # under srun: the task wrapper, from SLURM's environment, the job's own value set to 1
    (tmp_path / "plan.json").write_text(json.dumps(pj))
    env = dict(os.environ, SLURM_PROCID="9", SLURM_NTASKS="32", SLURM_NNODES="4", SLURM_NODEID="1", SLURM_LOCALID="1",
               PYTHONPATH=str(ROOT), CUDA_DEVICE_MAX_CONNECTIONS="inherited")
    r = subprocess.run([sys.executable, "-m", "orchestrator.launch.trainers", str(tmp_path), "--", "python", "-c",
                        _SHOW], capture_output=True, text=True, env=env, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["CUDA_DEVICE_MAX_CONNECTIONS"] == want
    # locally: the same command line for a 2-GPU attempt of the same plan's trainer section
    pj["config"]["trainer"]["command"] = f'python -c "{_SHOW}"'
    pj["config"]["trainer"]["args"] = []
    local = tmp_path / "local"
    local.mkdir()
    (local / "plan.json").write_text(json.dumps(pj))
    job = TrainerJob(local, nodes=1, gpus_per_node=2, env={"CUDA_DEVICE_MAX_CONNECTIONS": "inherited"}, echo=False)
    job.start()
    assert job.wait(timeout=60).ok
    for name in job.names:
        got = json.loads((local / "logs" / f"{name}.log").read_text().splitlines()[0])
        assert got["CUDA_DEVICE_MAX_CONNECTIONS"] == want and got["WORLD_SIZE"] == "2"


def test_megatron_fsdp_saves_in_its_own_format_and_the_other_shardings_in_megatrons_default():
    from orchestrator.frameworks.trainers import argv

    for zero, fmt in ((0, None), (1, None), (2, "fsdp_dtensor"), (3, "fsdp_dtensor")):
        p = plan_of(*SMALL, "trainer=megatron", "layout.tp=8", f"layout.zero={zero}", "training.checkpoint.every=10")
        assert p.valid, (zero, p.errors)
        f = flags(argv(p.to_json(), Path("/RUN")))
        assert f.get("--ckpt-format") == fmt and ("--use-megatron-fsdp" in f) == (zero >= 2), zero


def test_deepseek_v3_renders_mla_moe_and_mtp_for_megatron_and_dualpipe_names_a_schedule_it_has():
    from orchestrator.frameworks.trainers import argv

    p = plan_of("recipe=deepseek_v3", "trainer=megatron", "launcher=slurm")  # DualPipe
    assert [e.fix for e in p.errors if e.key == "schedule.name"][0].startswith("use schedule=1f1b"), p.errors
    p = plan_of("recipe=deepseek_v3", "trainer=megatron", "launcher=slurm", "schedule=interleaved_1f1b")
    assert p.valid, p.errors
    m = p.spec.model
    f = flags(argv(p.to_json(), Path("/RUN")))
    assert "--multi-latent-attention" in f
    assert (f["--q-lora-rank"], f["--kv-lora-rank"], f["--qk-head-dim"], f["--qk-pos-emb-head-dim"],
            f["--v-head-dim"]) == tuple(str(x) for x in (m.mla.q_lora_rank, m.mla.kv_lora_rank, m.mla.qk_nope_head_dim,
                                                          m.mla.qk_rope_head_dim, m.mla.v_head_dim))
    assert (f["--num-experts"], f["--moe-router-topk"], f["--moe-ffn-hidden-size"]) == ("256", "8", "2048")
    assert f["--moe-layer-freq"] == "([0]*3+[1]*58)" and f["--moe-shared-expert-intermediate-size"] == "2048"
    assert f["--moe-router-score-function"] == "sigmoid" and "--moe-router-enable-expert-bias" in f
    assert "--moe-grouped-gemm" in f and f["--moe-token-dispatcher-type"] == "alltoall"
    # node-limited routing: EP 64 spans 8 nodes of 8, each token reaches at most 4 of them
    assert (f["--moe-router-num-groups"], f["--moe-router-group-topk"]) == ("8", "4")
    assert f["--expert-model-parallel-size"] == "64" and f["--mtp-num-layers"] == "1"
    stages = f["--pipeline-model-parallel-layout"].split("|")
    assert stages[-1].endswith("mL")  # the MTP module after the last layer, before the loss


def test_what_megatron_lm_refuses_in_the_router_is_refused_before_launch():
    p = plan_of(*SMALL, "model=tiny_moe", "layout.ep=4", "layout.tp=2", "trainer=megatron", "model.moe.score=softmax")
    assert [e.key for e in p.errors] == ["model.moe.bias_update_speed, model.moe.score"], p.errors
    assert plan_of(*SMALL, "model=tiny_moe", "layout.ep=4", "layout.tp=2", "trainer=megatron",
                   "model.moe.score=softmax", "model.moe.bias_update_speed=0").valid
    # EP 20 over nodes of 8 spans 3 nodes: Megatron's 3 routing groups do not divide 20 experts
    p = plan_of(*SMALL, "cluster.nodes=5", "training.global_batch=80", "model=tiny_moe", "layout.ep=20", "layout.tp=2",
                "trainer=megatron",
                "model.moe.experts=20", "model.moe.max_nodes_per_token=1")
    assert [e.key for e in p.errors] == ["model.moe.max_nodes_per_token"], p.errors


def test_a_rope_base_megatron_cannot_parse_is_refused_and_an_integral_one_rendered_as_an_integer():
    from orchestrator.frameworks.trainers import argv

    p = plan_of(*SMALL, "trainer=megatron", "layout.tp=2", "model.rope_theta=1e6")
    assert p.valid, p.errors
    assert flags(argv(p.to_json(), Path("/RUN")))["--rotary-base"] == "1000000"  # argparse type=int
    p = plan_of(*SMALL, "trainer=megatron", "layout.tp=2", "model.rope_theta=12345.5")
    assert [e.key for e in p.errors] == ["model.rope_theta"] and "12346" in p.errors[0].fix
