"""External trainers (trainer=torchtitan, megatron, command): config, refusals, the rendered
command lines, the framework's own rank groups against the plan's, and the example script
trained under trainer=command through a node loss."""
from __future__ import annotations

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


# torchtitan runs Llama 3.1 405B with full activation checkpointing (its benchmarks/llama3_h100_202412_
# torchtitan.md, Tables 5-6): under torch's pipelining FSDP2 holds the unsharded fp32 gradients until the last
# micro-batch, and the recipe's own recompute (Meta's: none) does not fit torchtitan's stack
FULL_AC = ["training.recompute=full"]


# ---- config ----------------------------------------------------------------------------
def test_a_framework_trainer_plans_on_its_own_stack_unless_stack_is_given():
    from orchestrator import compose
    from orchestrator.config.compose import typed

    assert typed(compose(["recipe=llama3_405b", "trainer=torchtitan"])).stack.name == "torchtitan"
    assert typed(compose(["recipe=llama3_405b", "trainer=megatron"])).stack.name == "megatron_core"
    assert typed(compose(["recipe=llama3_405b"])).stack.name == "llama3_meta"  # the recipe's, without a trainer
    assert typed(compose(["trainer=torchtitan", "stack=megatron_core"])).stack.name == "megatron_core"
    for t in ("torchtitan", "megatron"):
        p = plan_of("recipe=llama3_405b", f"trainer={t}", "launcher=slurm", *(FULL_AC if t == "torchtitan" else []))
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
    for line in ("0.2", "0.3"):  # DeepSeek-V3 as published: DualPipe, ZeRO-1 and an MTP module torchtitan has not
        p = plan_of("recipe=deepseek_v3", "trainer=torchtitan", f"trainer.version={line}", "launcher=slurm",
                    "training.recompute=full")  # torchao's float8 keeps bf16 activations: selective does not fit
        assert sorted(e.key for e in p.errors) == ["layout.zero", "schedule.name", "training.mtp_depth"], p.errors
        assert all(e.fix for e in p.errors) and "training.mtp_depth=0" in p.errors[1].fix + p.errors[2].fix
    p = plan_of(*SMALL, "trainer=torchtitan", "trainer.version=0.3", "layout.tp=2", "training.precision=fp8")
    assert [e.key for e in p.errors] == ["training.precision"], p.errors  # 0.3: float8 is a registry entry
    p = plan_of("recipe=llama3_405b", "trainer=torchtitan", "trainer.version=0.3", "launcher=slurm", *FULL_AC)
    assert [e.key for e in p.errors] == ["training.precision"] and "precision=fp8" in p.errors[0].fix, p.errors
    assert plan_of(*SMALL, "trainer=torchtitan", "trainer.version=0.2", "layout.tp=2", "training.precision=fp8").valid
    # the CP method the plan prices is the one the framework runs, or the plan is refused
    cp = [*SMALL, "layout.tp=2", "layout.cp=2"]
    p = plan_of(*cp, "trainer=torchtitan", "trainer.version=0.3", "stack.cp_comm=p2p")
    assert [e.key for e in p.errors] == ["stack.cp_comm"] and "trainer.version=0.2" in p.errors[0].fix, p.errors
    for line in ("0.2", "0.3"):  # torch's CP rotates K/V shards; it has no Ulysses all-to-all of heads
        p = plan_of(*cp, "trainer=torchtitan", f"trainer.version={line}", "stack.cp_comm=a2a")
        assert [e.key for e in p.errors] == ["stack.cp_comm"], p.errors
    p = plan_of(*cp, "trainer=megatron", "layout.tp=8", "layout.cp=8", "cluster.nodes=8", "stack.cp_comm=a2a")
    assert [e.key for e in p.errors] == ["stack.cp_comm, layout.cp"], p.errors  # 8 KV heads / tp 8 over cp 8
    assert plan_of(*cp, "trainer=megatron", "stack.cp_comm=a2a").valid
    # the loss's kernels and torch.compile as planned, or refused: torchtitan runs torch's (eager or compiled),
    # async TP only on a compiled model; this runtime its eager one
    for line in ("0.2", "0.3"):
        p = plan_of(*SMALL, "trainer=torchtitan", f"trainer.version={line}", "layout.tp=2", "stack.cross_entropy=te")
        assert [e.key for e in p.errors] == ["stack.cross_entropy"] and "inductor" in p.errors[0].fix, p.errors
        p = plan_of(*SMALL, "trainer=torchtitan", f"trainer.version={line}", "layout.tp=2", "stack.tp_overlap=0.2")
        assert [e.key for e in p.errors] == ["stack.tp_overlap, stack.fused_elementwise"], p.errors
        assert plan_of(*SMALL, "trainer=torchtitan", f"trainer.version={line}", "layout.tp=2", "stack.tp_overlap=0.2",
                       "stack.fused_elementwise=true").valid
    for ce in ("te", "torch"):  # Megatron-LM refuses TE's fused loss (validate_args) and has no torch loss
        p = plan_of(*SMALL, "trainer=megatron", "layout.tp=2", f"stack.cross_entropy={ce}")
        assert [e.key for e in p.errors] == ["stack.cross_entropy"] and "megatron_fused" in p.errors[0].fix, p.errors
    from orchestrator.frameworks.trainers import argv  # the fused one as Megatron turns it on

    fused = plan_of(*SMALL, "trainer=megatron", "layout.tp=2", "stack.cross_entropy=megatron_fused")
    assert "--cross-entropy-loss-fusion" in argv(fused.to_json(), ROOT)
    assert "--cross-entropy-loss-fusion" not in argv(plan_of(*SMALL, "trainer=megatron", "layout.tp=2").to_json(), ROOT)
    p = plan_of("model=tiny", "hardware=cpu", "cluster.nodes=1", "launcher=local", "stack.cross_entropy=inductor")
    assert [e.key for e in p.errors] == ["stack.cross_entropy"], p.errors
    tiny = ["model=tiny", "hardware=cpu", "cluster.nodes=1", "layout.cp=2", "launcher=local"]
    p = plan_of(*tiny, "stack.cp_comm=p2p")  # this runtime all-gathers K/V (train/model.py _GatherSeq)
    assert [e.key for e in p.errors] == ["stack.cp_comm"] and "all_gather" in p.errors[0].fix, p.errors
    assert plan_of(*tiny).valid
    # torchtitan clips every step (max_norm 0 would zero the gradients); Megatron-LM's --clip-grad=0 turns it off
    p = plan_of(*SMALL, "trainer=torchtitan", "layout.tp=2", "training.max_norm=0")
    assert [e.key for e in p.errors] == ["training.max_norm"] and "training.max_norm > 0" in p.errors[0].fix, p.errors
    assert plan_of(*SMALL, "trainer=megatron", "layout.tp=2", "training.max_norm=0").valid
    for trainer in ("torchtitan", "megatron"):  # both save to a file system path, not an object store
        p = plan_of(*SMALL, f"trainer={trainer}", "layout.tp=2", "training.checkpoint.dir=s3://bucket/run")
        assert [e.key for e in p.errors] == ["training.checkpoint.dir"] and "s3://bucket/run" in p.errors[0].message


def test_what_the_installed_release_cannot_run_is_refused_before_launch(cli):
    """trainer.version unset: the line is the release installed for the ranks' interpreter, asked
    before launch (none here: 0.3, the newest), and what it refuses is a rejection, not a crash."""
    r = cli("recipe=llama3_405b", "trainer=torchtitan", "launcher=slurm", "launcher.submit=false", "figures=false",
            *FULL_AC)
    assert r.returncode == 2 and "[training.precision]" in r.stderr and "torchtitan 0.3" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "internal error" not in r.stdout + r.stderr


# ---- rendered arguments ------------------------------------------------------------------
def _preview(cli, trainer: str, *extra) -> str:
    r = cli("recipe=llama3_405b", f"trainer={trainer}", "launcher=slurm", "launcher.submit=false", "figures=false",
            "training.checkpoint.every=500", *extra)
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
    if trainer == "torchtitan":  # the preview says which release it rendered for
        assert f"rendered for torchtitan {extra[0].split('=')[1]} (trainer.version=" in r.stdout, r.stdout[-500:]
    return srun.split(" -- ", 1)[1].replace(str(cli.dir), "RUN")


@pytest.mark.parametrize("trainer", ["torchtitan-0.2", "torchtitan-0.3", "megatron"])
def test_slurm_preview_shows_the_framework_command_line_rendered_from_the_plan(cli, trainer):
    trainer, _, version = trainer.partition("-")
    # 0.3's llama3_405b registry entry trains float8 linears: the recipe in fp8 (TT_CASES llama3_405b_fp8)
    extra = {"": [], "0.2": ["trainer.version=0.2", *FULL_AC],
             "0.3": ["trainer.version=0.3", "training.precision=fp8", *FULL_AC]}
    line = _preview(cli, trainer, *extra[version])
    assert line == golden(f"trainer_{trainer}{'_' + version if version else ''}.txt", line)
    f = flags(line.split())
    if trainer == "torchtitan" and version == "0.3":  # the split as module names on the command line
        words = line.split()
        parts = words[words.index("--parallelism.module_fqns_per_model_part") + 1:][:16 * 7]
        assert parts[0] == "tok_embeddings,layers.0" and parts[-1].endswith("norm,lm_head")
        assert sum(p.count("layers.") for p in parts) == 126 and words[-1] == "activation-checkpoint:full"
        assert f["--parallelism.tensor_parallel_degree"] == "8" and f["--module"] == "" and "llama3" in words
        assert words[words.index("--config") + 1] == "llama3_405b"
    elif trainer == "torchtitan":  # TP8 PP16 DP64 interleaved over 7 chunks, the recipe's uneven split
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
                 [*SMALL, "layout.zero=3"], ["recipe=deepseek_v3", "schedule=1f1b", "launcher=slurm"],
                 [*SMALL, "model=tiny_moe", "layout.ep=8", "layout.zero=1", "training.precision=bf16",
                  "stack.ep_overlap=combined_1f1b_delay_wgrad"]):
        p = plan_of(*case, "trainer=megatron", "training.checkpoint.every=10")
        assert p.valid, p.errors
        rendered |= {a.split("=")[0] for a in trainers.argv(p.to_json(), Path("/RUN")) if a.startswith("--")}
    assert rendered <= set(megatron.CITED), rendered - set(megatron.CITED)
    assert {"--multi-latent-attention", "--moe-router-num-groups", "--mtp-num-layers", "--ckpt-format",
            "--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"} <= rendered
    root = os.environ.get("MEGATRON_LM")
    if not root:
        pytest.skip(f"set MEGATRON_LM to a Megatron-LM checkout at {megatron.COMMIT[:10]} to check the citations")
    import megatron_names

    found = megatron_names.names(Path(root))
    assert {k: found.get(k) for k in megatron.CITED} == megatron.CITED


# ---- torchtitan's own code on the rendered lines: one subprocess per release ----------------
TT_MOE = {"0.2": ["trainer.args=['--model.name=deepseek_v3','--model.flavor=debugmodel']"],
          "0.3": ["trainer.args=[--module, deepseek_v3, --config, deepseek_v3_debugmodel]"]}
# (id, overrides, lines it is for): recipes and hand layouts with PP, interleaving, CP, FSDP, HSDP, EP
TT_CASES = [
    ("llama3_405b", ["recipe=llama3_405b", "launcher=slurm", "training.checkpoint.every=500", *FULL_AC], ("0.2",)),
    # 0.3's llama3_405b registry entry trains float8 linears (0.3 refuses the recipe's bf16)
    ("llama3_405b_fp8", ["recipe=llama3_405b", "launcher=slurm", "training.checkpoint.every=500", *FULL_AC,
                         "training.precision=fp8"], ("0.2", "0.3")),
    ("llama3_405b_16k_fp8", ["recipe=llama3_405b_16k", "launcher=slurm", "training.precision=fp8", *FULL_AC],
     ("0.2", "0.3")),
    ("megatron_1t", ["recipe=megatron_1t", "launcher=slurm", "layout.zero=3"], ("0.2",)),  # no gpt_1t entry in 0.3
    # the recipe with what torchtitan runs instead of what it cannot (DualPipe, ZeRO-1, MTP): float8, EP64, PP16
    # (full recompute: torchao's float8 layers keep bf16 activations, too many for the recipe's selective)
    ("deepseek_v3", ["recipe=deepseek_v3", "launcher=slurm", "schedule=dualpipev", "layout.zero=2",
                     "training.mtp_depth=0", "training.recompute=full"], ("0.2", "0.3")),
    ("tp2", [*SMALL, "layout.tp=2", "training.checkpoint.every=10", "training.max_norm=0.5"], ("0.2", "0.3")),
    ("tp2pp2_dualpipev", [*SMALL, "layout.tp=2", "layout.pp=2", "schedule=dualpipev",
                          "training.recompute=selective"], ("0.2", "0.3")),
    ("tp2pp2_1f1b_order", [*SMALL, "layout.tp=2", "layout.pp=2", "layout.order=[tp,dp,pp]"], ("0.2", "0.3")),
    ("tp4pp2_interleaved", [*SMALL, "layout.tp=4", "layout.pp=2", "schedule=interleaved_1f1b", "layout.vp=2"],
     ("0.2", "0.3")),
    ("tp2cp2pp2", [*SMALL, "layout.tp=2", "layout.cp=2", "layout.pp=2"], ("0.2", "0.3")),
    ("tp2cp2_ring", [*SMALL, "layout.tp=2", "layout.cp=2", "stack.cp_comm=p2p"], ("0.2",)),  # 0.3 has no ring
    ("hsdp_tp2pp2", [*SMALL, "layout.tp=2", "layout.dp_shard=4", "layout.pp=2"], ("0.2", "0.3")),
    ("pp4tp2", [*SMALL, "layout.pp=4", "layout.tp=2", "training.recompute=none"], ("0.2", "0.3")),
    ("fsdp_tp8", [*SMALL, "layout.tp=8"], ("0.2", "0.3")),
    # torchtitan's 2025 benchmarks as planned: the model and the loss compiled, async TP
    ("tp2_compiled_async", [*SMALL, "layout.tp=2", "stack.fused_elementwise=true", "stack.cross_entropy=inductor",
                            "stack.tp_overlap=0.2"], ("0.2", "0.3")),
    ("moe_ep4tp2", [*SMALL, "model=tiny_moe", "layout.ep=4", "layout.tp=2"], ("0.2", "0.3")),
    ("moe_ep8tp2pp2", [*SMALL, "model=tiny_moe", "layout.ep=8", "layout.tp=2", "layout.pp=2"], ("0.2", "0.3")),
    # expert groups under the plan's orders: the last one torchtitan cannot build (refused at launch)
    ("moe_ep2tp2pp2", [*SMALL, "model=tiny_moe", "layout.ep=2", "layout.tp=2", "layout.pp=2"], ("0.2", "0.3")),
    ("moe_order_ep_tp", [*SMALL, "model=tiny_moe", "layout.ep=4", "layout.tp=2", "layout.order=[ep,tp,cp,dp,pp]"],
     ("0.2", "0.3")),
    ("moe_order_tp_dp_ep", [*SMALL, "model=tiny_moe", "layout.ep=8", "layout.tp=2", "layout.order=[tp,dp,ep,pp]"],
     ("0.2", "0.3")),
    # where the lines differ: 0.2 also runs experts with etp=tp (EP then leaves tp out); 0.3 refuses etp > 1
    ("moe_ep4etp2", [*SMALL, "model=tiny_moe", "layout.ep=4", "layout.tp=2", "layout.etp=2"], ("0.2",)),
    ("moe_ep4etp2_order_ep_tp", [*SMALL, "model=tiny_moe", "layout.ep=4", "layout.tp=2", "layout.etp=2",
                                 "layout.order=[ep,tp,cp,dp,pp]"], ("0.2",)),
]


@pytest.fixture(scope="module")
def torchtitan_runs(tmp_path_factory):
    """Each release's own code on every line rendered for it: {line: [(case id, plan json, argv, result)]}."""
    import json
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    import frameworks
    from orchestrator.frameworks import torchtitan
    from orchestrator.frameworks.trainers import argv, files

    # each release's subprocess starts first: it imports torch and torchtitan while this one plans
    code = f"import runpy; runpy.run_path({str(ROOT / 'tests' / 'torchtitan_ref.py')!r}, run_name='__main__')"
    procs = {line: subprocess.Popen([sys.executable, "-c", code], env=frameworks.env(f"torchtitan-{m.RELEASE}"),
                                    cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)
             for line, m in torchtitan.LINES.items() if frameworks.installed(f"torchtitan-{m.RELEASE}")}
    cases, meta = {line: [] for line in procs}, {}
    for line in procs:
        for cid, over, lines in TT_CASES:
            if line not in lines:
                continue
            extra = TT_MOE[line] if "model=tiny_moe" in over else []
            p = plan_of(*over, *extra, "trainer=torchtitan", f"trainer.version={line}")
            assert p.valid, (cid, line, p.errors)
            pj = p.to_json()
            plan_dir = tmp_path_factory.mktemp(f"{line}-{cid}")
            for fname, text in files(pj, line).items():
                (plan_dir / fname).write_text(text)
            words = argv(pj, plan_dir, line)
            assert words[:3] == ["python", "-m", "torchtitan.train"]
            cases[line].append({"id": cid, "argv": words[3:], "world": p.world_size})
            meta[line, cid] = (p, pj, words)

    def finish(line):
        try:
            return procs[line].communicate(json.dumps({"cases": cases[line]}), timeout=900)
        except subprocess.TimeoutExpired:
            procs[line].kill()
            return procs[line].communicate()

    with ThreadPoolExecutor(max(len(procs), 1)) as pool:  # the releases side by side
        done = dict(zip(procs, pool.map(finish, procs)))
    out = {}
    for line, (stdout, stderr) in done.items():
        results = [json.loads(x) for x in stdout.splitlines() if x.startswith("{")]
        assert len(results) == len(cases[line]), stderr[-5000:]
        out[line] = [(res["id"], *meta[line, res["id"]], res) for res in results]
    if not out:
        pytest.skip("no torchtitan release installed: python tests/frameworks.py (make test does)")
    return out


def test_selective_recompute_is_what_each_torchtitan_releases_own_policy_runs_again():
    """stack=torchtitan plans training.recompute=selective as the op-level selective AC the release runs
    (its own policy on its own Llama 3 blocks: tests/torchtitan_sac.py): the forward matmul FLOPs the
    plan adds per token for it (plan/model.py, Selective.every_other_matmul for 0.3's fused q/k/v,
    every_other_matmul_split_qkv for 0.2's) are the ones torch's FlopCounterMode counts again, and the
    plain forward and backward's matmuls are the plan's 6 x the blocks' and output's parameters."""
    import json
    import subprocess

    import frameworks
    from orchestrator import compose
    from orchestrator.frameworks import torchtitan
    from orchestrator.plan.model import ModelMath

    code = f"import runpy; runpy.run_path({str(ROOT / 'tests' / 'torchtitan_sac.py')!r}, run_name='__main__')"
    procs = {line: subprocess.Popen([sys.executable, "-c", code], env=frameworks.env(f"torchtitan-{m.RELEASE}"),
                                    cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for line, m in torchtitan.LINES.items() if frameworks.installed(f"torchtitan-{m.RELEASE}")}
    if not procs:
        pytest.skip("no torchtitan release installed: python tests/frameworks.py (make test does)")
    selective = {"0.2": "every_other_matmul_split_qkv", "0.3": "every_other_matmul"}
    for line, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        got = json.loads(out.strip().splitlines()[-1])
        spec = compose(["model=tiny", f"model.hidden={got['hidden']}", f"model.layers={got['layers']}",
                        f"model.heads={got['heads']}", f"model.kv_heads={got['kv_heads']}",
                        f"model.ffn_hidden={got['ffn_hidden']}", f"model.vocab={got['vocab']}"])
        mm = ModelMath(spec.model)
        linear = mm.total_params - mm.embed_params - mm.h * (1 + 2 * mm.L)  # less the embedding and the norms
        assert got["mm_plain"] == 6 * linear * got["tokens"], (line, got)
        again = sum(hw - model for model, hw in (mm.layer_flops(i, 32, False, "selective", selective[line])
                                                 for i in range(mm.L)))
        assert got["mm_selective"] - got["mm_plain"] == again * got["tokens"], (line, got, again)
        assert again > 0


def _plan_split(pj: dict) -> tuple[list[list[int]], list[int]]:
    """The plan's virtual stages (layers of each, in pipeline order) and the pp rank of each."""
    virtual = sorted(((v["stage"], v["layers"], st["pp_rank"]) for st in pj["layout"]["stages"]
                      for v in st["virtual"]))
    return [list(range(*lay)) for _, lay, _ in virtual], [r for *_, r in virtual]


@pytest.mark.parametrize("line", ["0.2", "0.3"])
def test_torchtitan_parses_every_rendered_line_and_reads_back_the_plan(torchtitan_runs, line):
    """torchtitan's own ConfigManager().parse_args (and, for 0.3, its Trainer.Config validation)
    on each rendered line, its split functions against the plan's stages."""
    if line not in torchtitan_runs:
        pytest.skip(f"torchtitan {line} not installed (python tests/frameworks.py)")
    splits = cps = compiles = 0
    for cid, p, pj, words, res in torchtitan_runs[line]:
        assert res["ok"], (cid, " ".join(words)[:3000], res.get("error"))
        lay, tr = pj["layout"], pj["config"]["training"]
        got = res["read"]
        shard, repl = (1, lay["dp"]) if lay["zero"] == 0 else (lay["dp_shard"], lay["dp_replicate"])
        assert (got["tp"], got["cp"], got["pp"], got["ep"], got["dp_shard"], got["dp_replicate"]) == \
            (lay["tp"], lay["cp"], lay["pp"], lay["ep"], shard, repl), cid
        assert got["global_batch"] == tr["global_batch"] and got["seq_len"] == tr["seq_len"], cid
        assert got["steps"] == tr["steps"] and got["seed"] == tr["seed"], cid
        assert got["max_norm"] == tr["max_norm"] > 0, cid  # the clip the plan prices (training.max_norm)
        assert got["fp8"] == (tr["precision"] == "fp8"), cid
        stack = pj["config"]["stack"]  # torch.compile where the plan prices compiled kernels, async TP on top
        assert got["compile"] == sorted((["model"] if stack["fused_elementwise"] else [])
                                        + (["loss"] if stack["cross_entropy"] == "inductor" else [])), cid
        assert got["async_tp"] == (lay["tp"] > 1 and stack["tp_overlap"] > 0), cid
        compiles += bool(got["compile"])
        if lay["cp"] > 1:  # the CP method priced is the one torch runs: its ALL_TO_ALL rotater passes each K/V
            # shard to rank + 1 (_context_parallel/_attention.py _AllToAllRotater), the ring (p2p)
            assert {"ALL_GATHER": "all_gather", "ALL_TO_ALL": "p2p"}[got["cp_rotation"]] == \
                pj["config"]["stack"]["cp_comm"], cid
            cps += 1
        assert got["local_batch"] * lay["dp"] == tr["global_batch"] or lay["pp"] == 1, cid
        if lay["pp"] > 1:
            assert got["micro_batch"] == lay["micro_batch"], cid
            if cid.startswith("moe") or cid == "megatron_1t":  # torchtitan's own debug model (trainer.args, or
                continue  # its default flavor for gpt_1t), not ours: the split is of another model
            assert (res["split"], res["stage_rank"]) == tuple(_plan_split(pj)), cid
            splits += 1
        ck = tr["checkpoint"]
        assert got["checkpoint"][0] == (ck["every"] > 0), cid
        if ck["every"] > 0:
            assert got["checkpoint"][2] == ck["every"], cid
    print(f"torchtitan {line}: {len(torchtitan_runs[line])} lines parsed and read back, {splits} stage splits, "
          f"{cps} CP methods, {compiles} compiled")
    assert splits >= 6 and cps >= {"0.2": 2, "0.3": 1}[line]  # 0.2: all-gather and the ring; 0.3: all-gather
    assert compiles >= 1


def _plan_mesh_groups(p, pj: dict) -> dict[str, set]:
    """The plan's groups of each torchtitan mesh dimension, as sets of the plan's GPU positions:
    the GPUs that agree on every coordinate of the plan's rank grid outside the dimension."""
    lay = pj["layout"]
    shard = lay["dp_shard"] if lay["zero"] else 1
    out = {dim: _plan_groups(pj, lambda c, dim=dim: {k: c[k] for k in c if k != dim})
           for dim in ("tp", "cp", "pp", "dp")}
    out["dp_shard"] = _plan_groups(pj, lambda c: {**{k: c[k] for k in c if k != "dp"}, "r": c["dp"] // shard})
    out["dp_replicate"] = _plan_groups(pj, lambda c: {**{k: c[k] for k in c if k != "dp"}, "s": c["dp"] % shard})
    if lay["ep"] > 1:
        out["ep"] = {frozenset(g) for g in p.expert_grid().groups("ep").tolist()}
    return out


def _torchtitan_groups(pj: dict, res: dict) -> dict[str, set]:
    """torchtitan's groups of each dimension (RANKs), as sets of the plan's GPU positions (rank_map)."""
    from orchestrator.frameworks.trainers import rank_map

    pos = {r: q for q, r in enumerate(rank_map(pj))}
    return {dim: {frozenset(pos[r] for r in g) for g in gs} for dim, gs in res["groups"].items()}


@pytest.mark.parametrize("line", ["0.2", "0.3"])
def test_torchtitans_own_groups_are_the_plans_for_every_rank(torchtitan_runs, line):
    """ParallelDims(...).build_mesh() under torch's fake process group: every group of its tp, cp,
    pp, dp_shard, dp_replicate, dp and ep dimensions (all ranks of the world), mapped to the plan's
    GPUs through rank_map, is the plan's group of those GPUs; each tp group within a node."""
    from orchestrator.frameworks.trainers import placement_problems

    if line not in torchtitan_runs:
        pytest.skip(f"torchtitan {line} not installed (python tests/frameworks.py)")
    compared = 0
    for cid, p, pj, words, res in torchtitan_runs[line]:
        assert res["ok"], (cid, res.get("error"))
        theirs, plan = _torchtitan_groups(pj, res), _plan_mesh_groups(p, pj)
        assert "dp" in theirs and all((d in theirs) == (pj["layout"][d] > 1) for d in ("tp", "cp", "pp", "ep")), \
            (cid, set(theirs))  # a dimension of degree 1 is not built
        for dim, groups in theirs.items():
            assert set().union(*groups) == set(range(p.world_size)), (cid, dim)  # every rank
            if dim == "ep" and placement_problems(p):
                continue  # an order torchtitan cannot build: refused at launch (the test below)
            assert groups == plan[dim], (cid, dim, sorted(map(sorted, groups))[:4], sorted(map(sorted, plan[dim]))[:4])
        gpn = p.spec.hardware.gpus_per_node
        assert all(len({q // gpn for q in g}) == 1 for g in theirs.get("tp", ())), cid
        compared += p.world_size
    print(f"torchtitan {line}: groups of {compared} ranks compared ({len(torchtitan_runs[line])} layouts)")
    assert compared >= 32


# ---- placement: the framework's own groups, built from RANK as the framework builds them ---
def _plan_groups(pj: dict, members) -> set:
    from orchestrator.plan.topology import RankGrid

    g = RankGrid(pj["ranks"]["sizes"], pj["ranks"]["order"])
    key = lambda p: tuple(v for a, v in sorted(members(g.coords(p)).items()))  # noqa: E731
    out: dict = {}
    for p in range(g.world):
        out.setdefault(key(p), set()).add(p)
    return {frozenset(v) for v in out.values()}


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


LAYOUTS = [["layout.tp=2", "layout.pp=2"], ["layout.tp=2", "layout.pp=2", "layout.order=[tp,dp,pp]"],
           ["layout.tp=4", "layout.pp=2", "layout.order=tp-pp-dp"], ["layout.tp=2", "layout.cp=2", "layout.pp=2"],
           ["layout.tp=2", "layout.dp_shard=4", "layout.pp=2"], ["layout.tp=8"], ["layout.pp=4", "layout.tp=2"]]


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

    steps = 16  # node 1 killed after step 5: 11 steps of margin for the launcher's kill to land before the end
    r = cli("hardware=cpu", "cluster.nodes=2", "hardware.gpus_per_node=2", "model=tiny", f"training.steps={steps}",
            "training.global_batch=8", "training.checkpoint.every=4", "launcher=local", "figures=false",
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


@pytest.mark.parametrize("line", ["0.2", "0.3"])
def test_an_order_whose_expert_groups_torchtitan_cannot_build_is_refused(torchtitan_runs, line):
    """torchtitan's own expert groups (build_mesh's ep dimension, every rank) against the plan's:
    the launcher refuses exactly the orders under which they differ, per release line."""
    from orchestrator.frameworks.trainers import placement_problems

    if line not in torchtitan_runs:
        pytest.skip(f"torchtitan {line} not installed (python tests/frameworks.py)")
    seen = {}
    for cid, p, pj, words, res in torchtitan_runs[line]:
        if pj["layout"]["ep"] == 1:
            continue
        assert res["ok"], (cid, res.get("error"))
        same = _torchtitan_groups(pj, res)["ep"] == _plan_mesh_groups(p, pj)["ep"]
        problems = placement_problems(p)
        assert bool(problems) == (not same), (cid, problems)
        assert not problems or problems[0].key == "layout.order, layout.ep", problems
        seen[cid] = same
    assert set(seen.values()) == {True, False}, seen
    if line == "0.3":  # the 0.2 layouts with etp=tp (moe_ep4etp2*): 0.3 has no expert_tensor_parallel_degree
        p = plan_of(*SMALL, "model=tiny_moe", "layout.ep=4", "layout.tp=2", "layout.etp=2", "trainer=torchtitan",
                    "trainer.version=0.3", *TT_MOE["0.3"])
        assert [e.key for e in p.errors] == ["layout.etp"], p.errors
    print(f"torchtitan {line}: expert groups as planned: {seen}")


def test_an_order_whose_expert_groups_megatron_cannot_build_is_refused(megatron_groups):
    """Megatron-Core's own expert groups (initialize_model_parallel from the placed RANKs) against
    the plan's: the launcher refuses exactly the orders under which they differ."""
    from orchestrator.frameworks.trainers import placement_problems, rank_map

    seen = set()
    for extra in EXPERT_ORDERS:
        p, g = megatron_groups[("model=tiny_moe", *extra)]
        assert p.valid, p.errors
        pos = {r: q for q, r in enumerate(rank_map(p.to_json()))}
        theirs = {frozenset(pos[r] for r in grp) for grp in g[megatron_core.EXPERT["ep"]]}
        same = theirs == {frozenset(grp) for grp in p.expert_grid().groups("ep").tolist()}
        assert bool(placement_problems(p)) == (not same), extra
        seen.add(same)
    assert seen == {True, False}


@pytest.mark.parametrize("trainer", ["torchtitan", "megatron"])
def test_such_an_order_is_refused_before_launch_with_the_key(trainer, cli):
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
