"""Megatron-LM's pretrain_gpt.py arguments from a plan, what it cannot run, and its rank order.

Every flag rendered is cited below from NVIDIA/Megatron-LM at d98e8a64dd (2026-08-22):
flags come from add_argument calls in megatron/training/arguments.py and from config
dataclass fields that its ArgumentGroupFactory turns into `--field-name`
(megatron/training/argument_utils.py:95-107); tests/test_trainers.py checks the table
against a Megatron-LM checkout when MEGATRON_LM is set. Rank groups: parallel_state's
RankGenerator with order 'tp-cp-ep-dp-pp', or 'tp-cp-ep-pp-dp' with --use-tp-pp-dp-mapping
(megatron/training/initialize.py:395).
"""
from __future__ import annotations

from pathlib import Path

from orchestrator.config.errors import Problem
from orchestrator.config.schema import Config, MLP, Precision, Recompute
from orchestrator.plan.layout import Layout
from orchestrator.plan.topology import RankGrid

COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"
STACKS = ("megatron_core", "megatron_lm_2023", "megatron_2021")
ORDERS = {"tp-cp-ep-dp-pp": [], "tp-cp-ep-pp-dp": ["--use-tp-pp-dp-mapping"]}
MPC, TC, TRC = ("megatron/core/model_parallel_config.py", "megatron/core/transformer/transformer_config.py",
                "megatron/training/config/training_config.py")
ARGS, CC = "megatron/training/arguments.py", "megatron/training/config/common_config.py"
CITED = {
    "--tensor-model-parallel-size": f"{MPC}:55", "--pipeline-model-parallel-size": f"{MPC}:83",
    "--context-parallel-size": f"{MPC}:100", "--expert-model-parallel-size": f"{MPC}:127",
    "--expert-tensor-parallel-size": f"{MPC}:130", "--sequence-parallel": f"{MPC}:94", "--bf16": f"{MPC}:180",
    "--num-layers-per-virtual-pipeline-stage": f"{ARGS}:3114", "--pipeline-model-parallel-layout": f"{ARGS}:3103",
    "--micro-batch-size": f"{TRC}:11", "--global-batch-size": f"{TRC}:15", "--train-iters": f"{TRC}:64",
    "--seq-length": f"{ARGS}:3305", "--max-position-embeddings": f"{ARGS}:2394",
    "--recompute-granularity": f"{TC}:532", "--recompute-method": f"{TC}:543", "--recompute-num-layers": f"{TC}:551",
    "--use-distributed-optimizer": f"{ARGS}:3156", "--use-megatron-fsdp": f"{CC}:92",
    "--data-parallel-sharding-strategy": f"{ARGS}:3190", "--use-tp-pp-dp-mapping": f"{CC}:105",
    "--save": f"{TRC}:395", "--load": f"{TRC}:430", "--save-interval": f"{TRC}:398", "--seed": f"{CC}:10",
    "--num-layers": f"{TC}:65", "--hidden-size": f"{TC}:145", "--ffn-hidden-size": f"{TC}:180",
    "--num-attention-heads": f"{TC}:148", "--group-query-attention": f"{ARGS}:2382", "--num-query-groups": f"{TC}:175",
    "--kv-channels": f"{TC}:184", "--swiglu": f"{ARGS}:2450", "--untie-embeddings-and-output-weights": f"{ARGS}:2460",
    "--num-experts": f"{ARGS}:3518", "--moe-router-topk": f"{TC}:760", "--moe-ffn-hidden-size": f"{TC}:740",
    "--moe-shared-expert-intermediate-size": f"{TC}:701", "--fp8-format": f"{TC}:587",
    "--overlap-grad-reduce": f"{ARGS}:3121", "--overlap-param-gather": f"{ARGS}:3148",
    "--num-distributed-optimizer-instances": f"{ARGS}:3216",
}
SHARDING = {2: "optim_grads", 3: "optim_grads_params"}  # Megatron-FSDP (arguments.py:3190)


def problems(spec: Config, layout: Layout) -> list[Problem]:
    out, sched = [], layout.schedule.name
    if layout.pp > 1 and sched not in ("1f1b", "interleaved_1f1b"):
        out.append(Problem("schedule.name", f"Megatron-LM has no {sched} schedule: it runs 1F1B, interleaved when "
                           f"a rank holds several virtual stages (megatron/core/pipeline_parallel/schedules.py).",
                           "use schedule=1f1b, or schedule=interleaved_1f1b with layout.vp>1."))
    if layout.vp > 1 and layout.pp <= 2:
        out.append(Problem("layout.vp, layout.pp", f"Megatron-LM interleaves only with pp > 2 unless p2p overlap is "
                           f"on (arguments.py:1000-1010); pp={layout.pp}.", "use layout.vp=1, or add "
                           "--overlap-p2p-comm to trainer.args."))
    if layout.dp_replicate > 1 and layout.zero != 1:
        out.append(Problem("layout.dp_shard", f"the plan keeps {layout.dp_replicate} copies of the state "
                           f"(dp {layout.dp} / dp_shard {layout.dp_shard}); Megatron-LM keeps copies of the "
                           f"distributed optimizer only (--num-distributed-optimizer-instances, zero=1).",
                           "leave layout.dp_shard unset, or set layout.zero=1."))
    if spec.model.mla.kv_lora_rank:
        out.append(Problem("model.mla", "the rendering has no MLA arguments.", "put them in trainer.args, or use "
                           "trainer=command."))
    if spec.training.precision in (Precision.mxfp8, Precision.nvfp4):
        out.append(Problem("training.precision", f"the rendering has no {spec.training.precision.value} "
                           f"arguments (it writes --fp8-format=hybrid for fp8).", "put Megatron-LM's recipe "
                           "arguments in trainer.args with training.precision=fp8, or use trainer=command."))
    return out


def order_of(plan_json: dict) -> str:
    """Megatron's order string closest to the plan's (the RANK map does the rest)."""
    order = [a for a in plan_json["layout"]["order"] if a != "ep"]
    return "tp-cp-ep-pp-dp" if order.index("pp") < order.index("dp") else "tp-cp-ep-dp-pp"


def _layout_string(counts: list[int]) -> str:
    """--pipeline-model-parallel-layout: 'E' embedding, 't' per layer, 'L' loss, '|' between
    virtual stages, stage j on rank j % pp (pipeline_parallel_layer_layout.py:41-56)."""
    stages = [f"t*{n}" if n else "" for n in counts]
    stages[0], stages[-1] = "E" + stages[0], stages[-1] + "L"
    out, i = "", 0
    while i < len(stages) - 1:  # runs of equal stages as (s|)*k, which the parser unrolls
        k = 1
        while i + k < len(stages) - 1 and stages[i + k] == stages[i]:
            k += 1
        out += f"({stages[i]}|)*{k}" if k > 1 else stages[i] + "|"
        i += k
    return out + stages[-1]


def render(plan_json: dict, run_dir: Path, plan_dir: Path | None = None) -> list[str]:
    lay, cfg = plan_json["layout"], plan_json["config"]
    tr, m = cfg["training"], cfg["model"]
    out = [f"--tensor-model-parallel-size={lay['tp']}", f"--pipeline-model-parallel-size={lay['pp']}",
           f"--context-parallel-size={lay['cp']}"]
    if lay["ep"] > 1:
        out += [f"--expert-model-parallel-size={lay['ep']}", f"--expert-tensor-parallel-size={lay['etp']}"]
    out += ORDERS[order_of(plan_json)]
    if lay["pp"] > 1:
        virtual = sorted((v for st in lay["stages"] for v in st["virtual"]), key=lambda v: v["stage"])
        counts = [v["layers"][1] - v["layers"][0] for v in virtual]
        even = len(set(counts)) == 1
        if even and lay["vp"] > 1:
            out.append(f"--num-layers-per-virtual-pipeline-stage={counts[0]}")
        elif not even:
            out.append(f"--pipeline-model-parallel-layout={_layout_string(counts)}")
    if lay["tp"] > 1 and cfg["layout"]["sequence_parallel"]:
        out.append("--sequence-parallel")
    out += [f"--micro-batch-size={lay['micro_batch']}", f"--global-batch-size={tr['global_batch']}",
            f"--seq-length={tr['seq_len']}", f"--max-position-embeddings={tr['seq_len']}",
            f"--train-iters={tr['steps']}", f"--seed={tr['seed']}"]
    out += [f"--num-layers={m['layers']}", f"--hidden-size={m['hidden']}", f"--ffn-hidden-size={m['ffn_hidden']}",
            f"--num-attention-heads={m['heads']}"]
    if m["kv_heads"] != m["heads"]:
        out += ["--group-query-attention", f"--num-query-groups={m['kv_heads']}"]
    if m.get("head_dim"):
        out.append(f"--kv-channels={m['head_dim']}")
    if m["mlp"] == MLP.swiglu.value:
        out.append("--swiglu")
    if not m["tied_embeddings"]:
        out.append("--untie-embeddings-and-output-weights")
    moe = m["moe"]
    if moe["experts"]:
        out += [f"--num-experts={moe['experts']}", f"--moe-router-topk={moe['experts_per_token']}",
                f"--moe-ffn-hidden-size={moe['expert_ffn_hidden']}"]
        if moe["shared_experts"]:
            out.append(f"--moe-shared-expert-intermediate-size={moe['shared_experts'] * moe['expert_ffn_hidden']}")
    if tr["precision"] != Precision.fp32.value:
        out.append("--bf16")
    if tr["precision"] == Precision.fp8.value:
        out.append("--fp8-format=hybrid")
    if tr["recompute"] == Recompute.full.value:
        n = tr["recompute_layers"]
        out += ["--recompute-granularity=full"] + (["--recompute-method=block", f"--recompute-num-layers={n}"]
                                                    if n is not None else
                                                    ["--recompute-method=uniform", "--recompute-num-layers=1"])
    elif tr["recompute"] == Recompute.selective.value:
        out.append("--recompute-granularity=selective")
    zero = lay["zero"]
    if zero == 1:
        out += ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
        if lay["dp_replicate"] > 1:
            out.append(f"--num-distributed-optimizer-instances={lay['dp_replicate']}")
    elif zero >= 2:
        out += ["--use-megatron-fsdp", f"--data-parallel-sharding-strategy={SHARDING[zero]}"]
    ck = tr["checkpoint"]
    if ck["every"] > 0:
        folder = (ck["dir"] or f"{run_dir}/checkpoints").removeprefix("file://")
        out += [f"--save={folder}", f"--load={folder}", f"--save-interval={ck['every']}"]
    return out


def files(plan_json: dict) -> dict[str, str]:
    """Megatron's command line names no file of ours."""
    return {}


def framework_rank(coords: dict, plan_json: dict) -> int:
    """The RANK whose coordinates in Megatron's dense RankGenerator (the order string, first
    axis innermost: rank = sum coord x stride) are these plan coordinates."""
    lay = plan_json["layout"]
    sizes = {"tp": lay["tp"], "cp": lay["cp"], "ep": 1, "dp": lay["dp"], "pp": lay["pp"]}
    return RankGrid(sizes, order_of(plan_json).split("-")).rank(coords)


def expert_groups(plan_json: dict) -> list[list[int]]:
    """Megatron's expert-parallel groups, in RANKs: its expert RankGenerator (etp in tp's slot,
    edp in dp's, cp 1) with the same order string."""
    lay = plan_json["layout"]
    sizes = {"tp": lay["etp"], "cp": 1, "ep": lay["ep"], "dp": lay["edp"], "pp": lay["pp"]}
    return RankGrid(sizes, order_of(plan_json).split("-")).groups("ep").tolist()
