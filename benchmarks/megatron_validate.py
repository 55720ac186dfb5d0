"""Megatron-LM's own parse_args + validate_args (and the TransformerConfig pretrain_gpt.py builds
from them) on the command lines trainer=megatron renders, over the recipes and a spread of dense
and MoE layouts on every GPU generation the presets name. Prints, per configuration, whether
Megatron-LM accepts the line and reads back the plan's TP, PP, VP, CP, EP, ETP, DP, micro and
global batch, gradient clip (training.max_norm), layer split and, with CP, the CP communication
(TransformerConfig.cp_comm_type, the method Transformer Engine's attention runs), then the count.

Run: .venv/bin/python benchmarks/megatron_validate.py [MEGATRON_LM_CHECKOUT]   (or $MEGATRON_LM)
Without a checkout it says so and exits 0. Megatron-LM runs in this process on the CPU, with:
- the environment the launcher gives rank 0 (launch/trainers.rank_env: RANK, WORLD_SIZE the
  plan's world, CUDA_DEVICE_MAX_CONNECTIONS set or removed) plus torchrun's;
- the data and optimizer arguments a user adds in trainer.args (mock data, a null tokenizer, lr);
- stand-ins for what the ranks' GPU container has and a CPU lacks: the GPU generation of the
  plan's hardware (Megatron's get_device_arch_version and torch.cuda.get_device_capability),
  Transformer Engine's version (2.10) and fused RoPE, triton (tests/framework_stubs), and
  typing.override on Python < 3.12 (Megatron-LM's main needs 3.12). Megatron's code is not changed.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import tempfile
import traceback
import typing
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ARCH = {"a100_80gb": 8, "h100_sxm": 9, "h200": 9, "h800": 9, "b200": 10, "gb200": 10, "gb300": 10}
USER = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "{vocab}", "--lr", "1e-4"]
RECIPES = [
    ["recipe=megatron_1t"], ["recipe=megatron_1t", "hardware=h100_sxm"], ["recipe=megatron_1t", "hardware=b200"],
    ["recipe=llama3_405b"], ["recipe=llama3_405b", "hardware=b200"], ["recipe=llama3_405b_16k"],
    ["recipe=deepseek_v3", "schedule=interleaved_1f1b"], ["recipe=deepseek_v3", "schedule=1f1b", "hardware=h100_sxm"],
    ["recipe=deepseek_v3", "schedule=1f1b", "hardware=b200"],
]
TEMPLATES = [
    ["model=llama3_70b", "cluster.nodes=16", "layout.tp=8", "layout.pp=4", "layout.vp=5", "schedule=interleaved_1f1b",
     "training.global_batch=512", "layout.allow_cross_node_tp=true"],
    ["model=llama3_70b", "cluster.nodes=16", "layout.tp=4", "layout.cp=2", "layout.pp=4", "training.seq_len=16384",
     "training.global_batch=256", "layout.zero=1"],
    ["model=llama3_8b", "cluster.nodes=4", "layout.tp=4", "layout.pp=2", "layout.order=tp-pp-dp",
     "training.global_batch=128", "training.recompute=full"],
    ["model=llama3_8b", "cluster.nodes=4", "layout.zero=3", "layout.tp=2", "training.global_batch=128"],
    ["model=llama3_8b", "cluster.nodes=4", "layout.zero=2", "training.global_batch=128"],
    ["model=llama3_8b", "cluster.nodes=4", "layout.zero=0", "layout.pp=2", "training.global_batch=128",
     "training.recompute=full", "training.precision=fp8"],
    ["model=llama3_8b", "cluster.nodes=4", "layout.tp=4", "layout.dp_shard=2", "layout.zero=1",
     "training.global_batch=128"],
    ["model=tiny_moe", "cluster.nodes=4", "layout.ep=8", "layout.tp=2", "layout.etp=1", "layout.pp=2",
     "training.global_batch=128", "layout.zero=1"],
    ["model=tiny_moe", "cluster.nodes=4", "layout.ep=4", "layout.tp=2", "layout.zero=3", "training.global_batch=128"],
    ["model=tiny_moe", "cluster.nodes=2", "layout.ep=8", "training.precision=fp32", "training.global_batch=64",
     "model.moe.score=softmax", "model.moe.bias_update_speed=0", "model.moe.aux_loss_coef=1e-4",
     "training.max_norm=0"],  # no clip: --clip-grad=0.0
    ["model=llama3_8b", "cluster.nodes=4", "layout.tp=2", "layout.cp=4", "training.recompute=selective",
     "training.seq_len=32768", "training.global_batch=32"],
    ["model=tiny_moe", "cluster.nodes=4", "layout.ep=16", "layout.tp=1", "model.moe.experts=32",
     "model.moe.max_nodes_per_token=1", "training.global_batch=128", "training.precision=fp8"],
]
# The CP methods besides the stack's default (p2p), read back as Transformer Engine will be given them
CP_METHODS = [["hardware=h100_sxm", *TEMPLATES[10], f"stack.cp_comm={k}"] for k in ("all_gather", "a2a")]
# The loss's fused kernels (stack.cross_entropy=megatron_fused), read back from TransformerConfig
LOSS = [["hardware=h100_sxm", *TEMPLATES[0], "stack.cross_entropy=megatron_fused"]]
# The expert all-to-all overlap (stack.ep_overlap: --overlap-moe-expert-parallel-comm, with --delay-wgrad-compute),
# read back from TransformerConfig: interleaved with TP on Hopper (Megatron-Bridge's Qwen3 235B H100 layout, scaled
# down), and without pipelining on Blackwell
EP_OVERLAP = [["hardware=h100_sxm", "model=tiny_moe", "cluster.nodes=4", "layout.ep=8", "layout.tp=2", "layout.etp=1",
               "layout.pp=4", "layout.vp=2", "model.layers=8", "schedule=interleaved_1f1b", "training.global_batch=128",
               "layout.zero=1", "training.precision=bf16",
               "stack.ep_overlap=combined_1f1b_delay_wgrad"],
              ["hardware=b200", "model=tiny_moe", "cluster.nodes=2", "layout.ep=8", "training.global_batch=64", "training.precision=bf16",
               "stack.ep_overlap=combined_1f1b"]]
CONFIGS = RECIPES + [[f"hardware={hw}", *t] for hw in ARCH for t in TEMPLATES] + CP_METHODS + LOSS + EP_OVERLAP


def megatron(root: str):
    """Megatron-LM's argument code from the checkout, with the stand-ins above."""
    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override
    sys.path[:0] = [root, str(ROOT / "tests" / "framework_stubs")]
    warnings.simplefilter("ignore")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        import megatron.core.utils as mcu
        import megatron.training.arguments as arguments
        from megatron.core.models.common.embeddings import rope_utils
        from megatron.training.argument_utils import gpt_config_from_args
        from packaging.version import Version
    mcu._te_version = Version("2.10.0")
    rope_utils.fused_apply_rotary_pos_emb = rope_utils.fused_apply_rotary_pos_emb or (lambda *a, **k: None)
    return arguments, gpt_config_from_args


def split_of(args) -> list[int]:
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    if args.pipeline_model_parallel_layout is not None:
        layout = args.pipeline_model_parallel_layout
        stages = PipelineParallelLayerLayout.parse_str_to_list(layout) if isinstance(layout, str) else \
            [st for vpp in range(layout.virtual_pipeline_model_parallel_size) for st in
             (row[vpp] for row in layout.layout)]
        return [sum(1 for x in st if x in (LayerType.decoder, "t", "decoder")) for st in stages]
    n = args.pipeline_model_parallel_size * (args.virtual_pipeline_model_parallel_size or 1)
    return [args.num_layers // n] * n


def readback(args, config, pj: dict) -> dict:
    from orchestrator.config.schema import clip_norm

    lay = pj["layout"]
    got = {"tp": args.tensor_model_parallel_size, "pp": args.pipeline_model_parallel_size,
           "vp": args.virtual_pipeline_model_parallel_size or 1, "cp": args.context_parallel_size,
           "ep": args.expert_model_parallel_size, "dp": args.data_parallel_size, "micro_batch": args.micro_batch_size,
           "global_batch": args.global_batch_size, "clip_grad": args.clip_grad}
    want = {k: lay[k] for k in ("tp", "pp", "vp", "cp", "ep", "dp", "micro_batch")}
    want["global_batch"] = pj["config"]["training"]["global_batch"]
    want["clip_grad"] = clip_norm(pj["config"]["training"]["max_norm"], pj["config"]["stack"]["grad_clip"])
    if lay["ep"] > 1:
        got["etp"], want["etp"] = args.expert_tensor_parallel_size, lay["etp"]
    fused = pj["config"]["stack"]["cross_entropy"] == "megatron_fused"  # the loss's kernels planned
    got["loss_fusion"], want["loss_fusion"] = (config.cross_entropy_loss_fusion, config.cross_entropy_fusion_impl), \
        (fused, "native")
    how = pj["config"]["stack"]["ep_overlap"]  # the all-to-all overlap planned
    got["ep_overlap"], want["ep_overlap"] = (config.overlap_moe_expert_parallel_comm, config.delay_wgrad_compute), \
        (how != "none", how == "combined_1f1b_delay_wgrad")
    if lay["cp"] > 1:  # what TransformerConfig hands Transformer Engine's attention: the CP method planned
        got["cp_comm"], want["cp_comm"] = config.cp_comm_type, pj["config"]["stack"]["cp_comm"]
    if lay["pp"] > 1:
        got["split"] = split_of(args)
        virtual = sorted((v for st in lay["stages"] for v in st["virtual"]), key=lambda v: v["stage"])
        want["split"] = [v["layers"][1] - v["layers"][0] for v in virtual]
    return {k: (want[k], got[k]) for k in want if want[k] != got[k]}


def check(arguments, gpt_config_from_args, overrides: list[str]) -> tuple[str, str]:
    import torch

    from orchestrator import compose, make_plan
    from orchestrator.config.compose import typed
    from orchestrator.frameworks.trainers import argv
    from orchestrator.launch.processes import apply
    from orchestrator.launch.trainers import rank_env

    plan = make_plan(typed(compose([*overrides, "trainer=megatron", "launcher=slurm"])))
    if not plan.valid:
        return "refused before launch", "; ".join(f"[{e.key}] {e.message[:100]}" for e in plan.errors)
    pj = plan.to_json()
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "plan.json").write_text(json.dumps(pj))
        words = argv(pj, Path(d))
        env = {**rank_env(Path(d), 0, pj["world_size"]), "LOCAL_RANK": "0", "GROUP_RANK": "0",
               "LOCAL_WORLD_SIZE": str(pj["config"]["hardware"]["gpus_per_node"])}
    arch = ARCH[pj["config"]["hardware"]["name"]]
    arguments.get_device_arch_version = lambda: arch
    torch.cuda.get_device_capability = lambda *a: (arch, 0)
    saved_env, saved_argv = dict(os.environ), sys.argv
    os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    apply(os.environ, env)
    sys.argv = ["pretrain_gpt.py", *words[2:], *(w.format(vocab=pj["config"]["model"]["vocab"]) for w in USER)]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            args = arguments.parse_args()
            arguments.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
            config = gpt_config_from_args(args)  # TransformerConfig.__post_init__: MLA, MoE, layout checks
    except SystemExit:
        return "REFUSED (argparse)", out.getvalue()[-300:].replace("\n", " ")
    except Exception as e:  # noqa: BLE001 - Megatron refuses with asserts and ValueErrors
        return "REFUSED", f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        sys.argv = saved_argv
    diff = readback(args, config, pj)
    key = "CUDA_DEVICE_MAX_CONNECTIONS"
    conn = (env[key] or "removed") if key in env else "left as inherited"
    return ("accepted" if not diff else "ACCEPTED, READ BACK DIFFERS"), \
        (f"differs {diff}; " if diff else "") + f"{key}: {conn}"


def main() -> int:
    root = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("MEGATRON_LM")
    if not root or not (Path(root) / "megatron" / "training" / "arguments.py").exists():
        print("no Megatron-LM checkout given (argument or $MEGATRON_LM): skipped")
        return 0
    arguments, gpt_config = megatron(root)
    verdicts = []
    for ov in CONFIGS:
        try:
            verdict, detail = check(arguments, gpt_config, ov)
        except Exception:  # noqa: BLE001
            verdict, detail = "ERROR", traceback.format_exc()[-500:]
        verdicts.append(verdict)
        print(f"{verdict:26} {' '.join(ov)}\n{'':26} {detail}", flush=True)
    rendered = [v for v in verdicts if v != "refused before launch"]
    print(f"\nMegatron-LM ({root}) accepts and reads back {verdicts.count('accepted')} of {len(rendered)} rendered "
          f"command lines; {len(verdicts) - len(rendered)} of {len(verdicts)} configurations refused before launch")
    return 0 if verdicts.count("accepted") == len(rendered) else 1


if __name__ == "__main__":
    sys.exit(main())
