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
from orchestrator.config.schema import Config, MLP, Precision, Recompute, clip_norm
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
    "--context-parallel-size": f"{MPC}:100", "--cp-comm-type": f"{ARGS}:3221", "--expert-model-parallel-size": f"{MPC}:127",
    "--expert-tensor-parallel-size": f"{MPC}:130", "--sequence-parallel": f"{MPC}:94", "--bf16": f"{MPC}:180",
    "--num-layers-per-virtual-pipeline-stage": f"{ARGS}:3114", "--pipeline-model-parallel-layout": f"{ARGS}:3103",
    "--micro-batch-size": f"{TRC}:11", "--global-batch-size": f"{TRC}:15", "--train-iters": f"{TRC}:64",
    "--seq-length": f"{ARGS}:3305", "--max-position-embeddings": f"{ARGS}:2394",
    "--recompute-granularity": f"{TC}:532", "--recompute-method": f"{TC}:543", "--recompute-num-layers": f"{TC}:551",
    "--use-distributed-optimizer": f"{ARGS}:3156", "--use-megatron-fsdp": f"{CC}:92",
    "--data-parallel-sharding-strategy": f"{ARGS}:3190", "--use-tp-pp-dp-mapping": f"{CC}:105",
    "--save": f"{TRC}:395", "--load": f"{TRC}:430", "--save-interval": f"{TRC}:398", "--seed": f"{CC}:10",
    "--clip-grad": f"{ARGS}:2615",
    "--num-layers": f"{TC}:65", "--hidden-size": f"{TC}:145", "--ffn-hidden-size": f"{TC}:180",
    "--num-attention-heads": f"{TC}:148", "--group-query-attention": f"{ARGS}:2382", "--num-query-groups": f"{TC}:175",
    "--kv-channels": f"{TC}:184", "--swiglu": f"{ARGS}:2450", "--untie-embeddings-and-output-weights": f"{ARGS}:2460",
    "--num-experts": f"{ARGS}:3518", "--moe-router-topk": f"{TC}:760", "--moe-ffn-hidden-size": f"{TC}:740",
    "--moe-shared-expert-intermediate-size": f"{TC}:701", "--fp8-format": f"{TC}:587",
    "--overlap-grad-reduce": f"{ARGS}:3121", "--overlap-param-gather": f"{ARGS}:3148",
    "--num-distributed-optimizer-instances": f"{ARGS}:3216", "--ckpt-format": f"{TRC}:486",
    "--disable-bias-linear": f"{TC}:212", "--moe-layer-freq": f"{ARGS}:3520", "--moe-grouped-gemm": f"{TC}:850",
    "--moe-token-dispatcher-type": f"{TC}:891", "--moe-router-score-function": f"{TC}:808",
    "--moe-router-pre-softmax": f"{TC}:799", "--moe-router-topk-scaling-factor": f"{TC}:804",
    "--moe-router-enable-expert-bias": f"{TC}:816", "--moe-router-bias-update-rate": f"{TC}:821",
    "--moe-router-load-balancing-type": f"{ARGS}:3532", "--moe-aux-loss-coeff": f"{ARGS}:3536",
    "--moe-router-num-groups": f"{TC}:780", "--moe-router-group-topk": f"{TC}:796",
    "--multi-latent-attention": f"{TC}:288", "--q-lora-rank": f"{ARGS}:3548", "--kv-lora-rank": f"{ARGS}:3550",
    "--qk-head-dim": f"{ARGS}:3552", "--qk-pos-emb-head-dim": f"{ARGS}:3554", "--v-head-dim": f"{ARGS}:3556",
    "--mtp-num-layers": f"{TC}:68", "--position-embedding-type": f"{ARGS}:2397", "--rotary-base": f"{ARGS}:2418",
    "--normalization": f"{TC}:256", "--cross-entropy-loss-fusion": f"{MPC}:320",
    "--overlap-moe-expert-parallel-comm": f"{MPC}:343", "--delay-wgrad-compute": f"{MPC}:348",
}
# What each rank's environment must hold (validate_args, arguments.py): with TP or CP, before
# Blackwell, CUDA_DEVICE_MAX_CONNECTIONS=1 unless an FSDP runs (1452-1479; from Blackwell on 1 is
# no longer required but still accepted); Megatron-FSDP refuses 1 (1166-1167): unset it there.
# With the expert all-to-all overlap (stack.ep_overlap) validate_args only warns with TP or CP before
# Blackwell (1466-1474: the overlap "requires setting a larger CUDA_DEVICE_MAX_CONNECTIONS"); Megatron-LM's
# own run guide sets 32 for it (skills/mcore-run-on-slurm/SKILL.md:27-29,102; more than 1, as an FSDP needs), so its communication stream's
# all-to-alls are not queued behind the other stream's kernels.
CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"
# stack.ep_overlap: Megatron-Core's combined 1F1B, and the weight gradients apart with it
EP_OVERLAP = {"none": [], "combined_1f1b": ["--overlap-moe-expert-parallel-comm"],
              "combined_1f1b_delay_wgrad": ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"]}
SHARDING = {2: "optim_grads", 3: "optim_grads_params"}  # Megatron-FSDP (arguments.py:3190)
# --cp-comm-type is stack.cp_comm's word: Megatron passes it to Transformer Engine's attention
# (megatron/core/extensions/transformer_engine.py:2141-2153), which runs every value the schema has,
# "p2p" (the ring), "all_gather" and "a2a" (NVIDIA/TransformerEngine transformer_engine/pytorch/
# attention/dot_product_attention/context_parallel.py attn_forward_func_with_cp); Megatron's default is
# p2p (arguments.py:3221). Its "a2a+p2p" (with --hierarchical-context-parallel-sizes) the schema lacks.


# The loss (stack.cross_entropy): vocab_parallel_cross_entropy by default (megatron), its fused regions
# with --cross-entropy-loss-fusion (megatron_fused; --cross-entropy-fusion-impl native, the default,
# model_parallel_config.py:320-325). Transformer Engine's kernel (te) validate_args refuses at this commit
# ("disabled due to stability issues", arguments.py:1697-1702); torch's loss Megatron does not run.
CROSS_ENTROPY = {"megatron": [], "megatron_fused": ["--cross-entropy-loss-fusion"]}


def problems(spec: Config, layout: Layout) -> list[Problem]:
    out, sched = [], layout.schedule.name
    ce = spec.stack.cross_entropy.value
    if ce not in CROSS_ENTROPY:
        why = ("Megatron-LM refuses Transformer Engine's cross-entropy fusion (validate_args: 'disabled due to "
               "stability issues')" if ce == "te" else f"Megatron-LM computes the loss with its own kernels, not {ce}'s")
        out.append(Problem("stack.cross_entropy", f"{why}; the plan prices {ce}.",
                           "set stack.cross_entropy=megatron (its default) or megatron_fused "
                           "(--cross-entropy-loss-fusion)."))
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
    mla, moe = spec.model.mla, spec.model.moe
    if spec.model.rope_theta != int(spec.model.rope_theta):
        out.append(Problem("model.rope_theta", f"Megatron-LM's --rotary-base is an integer (arguments.py:2418); "
                           f"rope_theta={spec.model.rope_theta}.", f"use model.rope_theta={round(spec.model.rope_theta)}."))
    if mla.kv_lora_rank and not (mla.q_lora_rank and mla.qk_rope_head_dim and mla.qk_nope_head_dim
                                 and mla.v_head_dim):
        out.append(Problem("model.mla", f"Megatron-LM's MLA takes every rank and head width (q_lora_rank "
                           f"{mla.q_lora_rank}, qk_rope_head_dim {mla.qk_rope_head_dim}, qk_nope_head_dim "
                           f"{mla.qk_nope_head_dim}, v_head_dim {mla.v_head_dim}).",
                           "set all of model.mla (DeepSeek-V3: 1536, 512, 64, 128, 128)."))
    if moe.experts and moe.score.value == "softmax" and moe.bias_update_speed:
        out.append(Problem("model.moe.bias_update_speed, model.moe.score", f"Megatron-LM's auxiliary-loss-free "
                           f"expert bias takes sigmoid gates only (transformer_config.py:2617-2624); score=softmax "
                           f"with bias_update_speed={moe.bias_update_speed}.",
                           "set model.moe.bias_update_speed=0 with softmax, or model.moe.score=sigmoid."))
    groups = _route_groups(spec.model.moe.experts, layout.ep, spec.hardware.gpus_per_node,
                           moe.max_nodes_per_token)
    if groups and moe.experts % groups:
        out.append(Problem("model.moe.max_nodes_per_token", f"Megatron-LM limits routing to "
                           f"{moe.max_nodes_per_token} of the {groups} nodes an expert group spans by dividing "
                           f"the {moe.experts} experts into {groups} groups (--moe-router-num-groups, "
                           f"transformer_config.py:2682); they do not divide.",
                           "set model.moe.max_nodes_per_token=0, or an ep whose node count divides the experts."))
    kv = spec.model.heads if mla.kv_lora_rank else spec.model.kv_heads
    if layout.cp > 1 and spec.stack.cp_comm.value == "a2a" and ((spec.model.heads // layout.tp) % layout.cp
                                               or max(kv // layout.tp, 1) % layout.cp):
        out.append(Problem("stack.cp_comm, layout.cp", f"Transformer Engine's a2a context parallelism scatters "
                           f"each tensor rank's heads over the CP group and needs them to divide by cp "
                           f"(context_parallel.py: 'requires num_heads % cp_size == 0'); {spec.model.heads} query "
                           f"and {kv} key/value heads over tp={layout.tp} do not divide by cp={layout.cp}.",
                           "set stack.cp_comm=p2p, or a cp that divides the heads per tensor rank."))
    if spec.stack.ep_overlap.value != "none" and layout.zero >= 2 and layout.vp > 1:
        out.append(Problem("stack.ep_overlap, layout.zero, layout.vp", "Megatron-Core's combined 1F1B refuses "
                           "Megatron-FSDP under the interleaved pipeline (combined_1f1b.py "
                           "combined_1f1b_schedule_for_interleaved_pipelining: 'EP overlap 1F1B with FSDP is not "
                           f"supported for interleaved pipeline parallelism'); zero={layout.zero}, vp={layout.vp}.",
                           "use layout.zero=1 (the distributed optimizer), layout.pp=1, or stack.ep_overlap=none."))
    if spec.training.precision in (Precision.mxfp8, Precision.nvfp4):
        out.append(Problem("training.precision", f"the rendering has no {spec.training.precision.value} "
                           f"arguments (it writes --fp8-format=hybrid for fp8).", "put Megatron-LM's recipe "
                           "arguments in trainer.args with training.precision=fp8, or use trainer=command."))
    return out


def _route_groups(experts: int, ep: int, gpus_per_node: int, max_nodes: int) -> int:
    """Node-limited routing in Megatron's terms: --moe-router-num-groups = the nodes one expert
    group spans (transformer_config.py:780-796), 0 when the limit binds nothing."""
    nodes = -(-ep // gpus_per_node)
    return nodes if experts and max_nodes and nodes > max_nodes else 0


def env(plan_json: dict) -> dict[str, str | None]:
    """The variables every rank gets beyond torchrun's (None: removed from the rank's environment)."""
    lay = plan_json["layout"]
    if plan_json["config"]["stack"]["ep_overlap"] != "none":
        return {CONNECTIONS: "32"}
    if lay["zero"] >= 2:
        return {CONNECTIONS: None}
    if lay["tp"] > 1 or lay["cp"] > 1:
        return {CONNECTIONS: "1"}
    return {}


def order_of(plan_json: dict) -> str:
    """Megatron's order string closest to the plan's (the RANK map does the rest)."""
    order = [a for a in plan_json["layout"]["order"] if a != "ep"]
    return "tp-cp-ep-pp-dp" if order.index("pp") < order.index("dp") else "tp-cp-ep-dp-pp"


def _layout_string(counts: list[int], mtp: int = 0) -> str:
    """--pipeline-model-parallel-layout: 'E' embedding, 't' per layer, 'm' per multi-token
    prediction module (after the last layer), 'L' loss, '|' between virtual stages, stage j on
    rank j % pp (pipeline_parallel_layer_layout.py:41-56, 86-136)."""
    stages = [f"t*{n}" if n else "" for n in counts]
    stages[0], stages[-1] = "E" + stages[0], stages[-1] + "m" * mtp + "L"
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
    if lay["cp"] > 1:  # the CP communication the plan priced (stack.cp_comm), not Megatron's default
        out.append(f"--cp-comm-type={cfg['stack']['cp_comm']}")
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
            out.append(f"--pipeline-model-parallel-layout={_layout_string(counts, tr['mtp_depth'])}")
    if lay["tp"] > 1 and cfg["layout"]["sequence_parallel"]:
        out.append("--sequence-parallel")
    out += [f"--micro-batch-size={lay['micro_batch']}", f"--global-batch-size={tr['global_batch']}",
            f"--seq-length={tr['seq_len']}", f"--max-position-embeddings={tr['seq_len']}",
            f"--train-iters={tr['steps']}", f"--seed={tr['seed']}",
            # the global gradient norm it clips at, 0: none (optimizer.py: clip only if clip_grad > 0)
            f"--clip-grad={clip_norm(tr['max_norm'], cfg['stack']['grad_clip'])}"]
    out += _model_args(m, lay, cfg["hardware"]["gpus_per_node"], tr["mtp_depth"])
    out += CROSS_ENTROPY.get(cfg["stack"]["cross_entropy"], [])  # the loss's kernels the plan priced
    out += EP_OVERLAP[cfg["stack"]["ep_overlap"]]  # the all-to-all overlap the plan priced
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
    elif zero >= 2:  # Megatron-FSDP saves only its own format (arguments.py:1169-1170)
        out += ["--use-megatron-fsdp", f"--data-parallel-sharding-strategy={SHARDING[zero]}",
                "--ckpt-format=fsdp_dtensor"]
    ck = tr["checkpoint"]
    if ck["every"] > 0:
        folder = (ck["dir"] or f"{run_dir}/checkpoints").removeprefix("file://")
        out += [f"--save={folder}", f"--load={folder}", f"--save-interval={ck['every']}"]
    return out


def _model_args(m: dict, lay: dict, gpus_per_node: int, mtp: int) -> list[str]:
    """The model's shape: attention (GQA or MLA), MLP, embeddings, experts, MTP."""
    out = [f"--num-layers={m['layers']}", f"--hidden-size={m['hidden']}", f"--ffn-hidden-size={m['ffn_hidden']}",
            f"--num-attention-heads={m['heads']}"]
    if m["kv_heads"] != m["heads"]:
        out += ["--group-query-attention", f"--num-query-groups={m['kv_heads']}"]
    # rotary embeddings (the planner's model and the runtime's: rope_theta); Megatron's default is learned
    out += ["--position-embedding-type=rope", f"--rotary-base={int(m['rope_theta'])}"]
    if m.get("head_dim"):
        out.append(f"--kv-channels={m['head_dim']}")
    if m["mlp"] == MLP.swiglu.value:
        out.append("--swiglu")
        # Llama/DeepSeek: RMSNorm, no biases (and Megatron's MoE biases need etp 1, transformer_config.py:2612)
        out += ["--normalization=RMSNorm", "--disable-bias-linear"]
    if not m["tied_embeddings"]:
        out.append("--untie-embeddings-and-output-weights")
    mla = m["mla"]
    if mla["kv_lora_rank"]:
        out += ["--multi-latent-attention", f"--q-lora-rank={mla['q_lora_rank']}",
                f"--kv-lora-rank={mla['kv_lora_rank']}", f"--qk-head-dim={mla['qk_nope_head_dim']}",
                f"--qk-pos-emb-head-dim={mla['qk_rope_head_dim']}", f"--v-head-dim={mla['v_head_dim']}"]
    out += _moe_args(m["moe"], lay, m["layers"], gpus_per_node)
    if mtp:
        out.append(f"--mtp-num-layers={mtp}")
    return out


def _moe_args(moe: dict, lay: dict, layers: int, gpus_per_node: int) -> list[str]:
    """Experts, their router and their kernels (transformer_config.py:700-900)."""
    if not moe["experts"]:
        return []
    out = [f"--num-experts={moe['experts']}", f"--moe-router-topk={moe['experts_per_token']}",
           f"--moe-ffn-hidden-size={moe['expert_ffn_hidden']}", "--moe-grouped-gemm",
           "--moe-token-dispatcher-type=alltoall"]
    if moe["dense_layers"]:  # a Python list expression, evaluated by Megatron (arguments.py moe_freq_type)
        k = moe["dense_layers"]
        out.append(f"--moe-layer-freq=([0]*{k}+[1]*{layers - k})")
    if moe["shared_experts"]:
        out.append(f"--moe-shared-expert-intermediate-size={moe['shared_experts'] * moe['expert_ffn_hidden']}")
    # the runtime's router (orchestrator/train/moe.py): sigmoid gates normalised over the chosen
    # experts, or the chosen entries of the softmax over all experts (Megatron's pre-softmax)
    out.append(f"--moe-router-score-function={moe['score']}")
    if moe["score"] == "softmax":
        out.append("--moe-router-pre-softmax")
    if moe["route_scale"] != 1.0:
        out.append(f"--moe-router-topk-scaling-factor={moe['route_scale']}")
    if moe["bias_update_speed"] and moe["score"] == "sigmoid":
        out += ["--moe-router-enable-expert-bias", f"--moe-router-bias-update-rate={moe['bias_update_speed']}"]
    out += ([f"--moe-router-load-balancing-type=seq_aux_loss", f"--moe-aux-loss-coeff={moe['aux_loss_coef']}"]
            if moe["aux_loss_coef"] else ["--moe-router-load-balancing-type=none"])
    groups = _route_groups(moe["experts"], lay["ep"], gpus_per_node, moe["max_nodes_per_token"])
    if groups:
        out += [f"--moe-router-num-groups={groups}", f"--moe-router-group-topk={moe['max_nodes_per_token']}"]
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
