"""torchtitan 0.3 (torchtitan==0.3.0 on PyPI): a config registry per model, chosen with
`--module M --config C` (torchtitan/config/manager.py ConfigManager._load_config; the functions
of torchtitan/models/<M>/config_registry.py), then tyro overrides of the Trainer.Config
dataclasses (torchtitan/trainer.py, torchtitan/config/configs.py): `--section.field value`,
booleans as bare flags, `--dump_folder` at the top, the seed in `--debug.seed`, no config file;
float8 (training.precision=fp8) is the model's *_float8 registry entry (model_spec is not on the
command line); a split only module names express goes in
`--parallelism.module_fqns_per_model_part A,B C,D` (one comma-separated word per part); the
last module is `lm_head`. Activation checkpointing is
a tyro subcommand (`activation-checkpoint:full|selective|none`) and, as a subcommand, comes
after every other option, so after trainer.args. Trainer.Config.__post_init__ refuses pipeline
parallelism, and expert parallelism with its default token dispatcher, unless
`--training.disable_cuda_graphs` is given. No expert_tensor_parallel_degree: EP takes its ranks
from dp_shard x cp x tp, innermost (torchtitan/distributed/parallel_dims.py, the sparse mesh
pp, dp_replicate, efsdp, ep), i.e. etp=1."""
from __future__ import annotations

from pathlib import Path

from orchestrator.config.errors import Problem
from orchestrator.frameworks.torchtitan.common import checkpoint_words, compiled
from orchestrator.config.schema import Config, Precision

LINE = "0.3"
RELEASE = "0.3.0"
OUTPUT = "lm_head"  # torchtitan/distributed/pipeline_parallel.py _generate_llm_fqn_per_model_part
# (our model, float8?) -> (--module, --config): functions of torchtitan/models/<module>/config_registry.py.
# float8 is the entry's own (converters on its model_spec, which is not on the command line):
# llama3_405b's entry always trains float8 linears, llama3_8b/70b's never, deepseek_v3 has both.
CONFIGS = {("llama3_8b", False): ("llama3", "llama3_8b"), ("llama3_70b", False): ("llama3", "llama3_70b"),
           ("llama3_405b", True): ("llama3", "llama3_405b"),
           ("deepseek_v3", False): ("deepseek_v3", "deepseek_v3_671b"),
           ("deepseek_v3", True): ("deepseek_v3", "deepseek_v3_671b_float8")}
MODELS = sorted({m for m, _ in CONFIGS})
AC = {"none": "activation-checkpoint:none", "selective": "activation-checkpoint:selective",
      "full": "activation-checkpoint:full"}


def _given(args) -> bool:
    words = " ".join(str(a) for a in args or [])
    return "--module" in words and "--config" in words


def problems(spec: Config, layout, module_names_needed: bool) -> list[Problem]:
    out = []
    if spec.trainer.config_file:
        out.append(Problem("trainer.config_file", "torchtitan 0.3 reads no config file (it picks a config from its "
                           "registry with --module and --config).", "unset trainer.config_file; put --module M "
                           "--config C and your overrides in trainer.args."))
    fp8 = spec.training.precision == Precision.fp8
    if not _given(spec.trainer.args):
        if spec.model.name not in MODELS:
            out.append(Problem("model, trainer.args", f"torchtitan 0.3 trains a model from its config registry; "
                               f"{spec.model.name} has no entry the launcher knows ({MODELS}).",
                               "put its registry entry in trainer.args, e.g. 'trainer.args=[--module, llama3, "
                               "--config, llama3_debugmodel]', or use model= one of those."))
        elif (spec.model.name, fp8) not in CONFIGS:
            has = "float8" if fp8 else spec.training.precision.value
            out.append(Problem("training.precision", f"torchtitan 0.3 turns float8 on or off in the registry entry "
                               f"(its model_spec is not on the command line), and it has no {spec.model.name} entry "
                               f"in {has}: {CONFIGS[spec.model.name, not fp8][1]} trains "
                               f"{'bf16' if fp8 else 'float8'} linears.",
                               f"set training.precision={'bf16' if fp8 else 'fp8'}, or name a registry entry of your "
                               f"own in trainer.args (--module M --config C)."))
    if spec.training.mtp_depth > 0 and not _given(spec.trainer.args):
        out.append(Problem("training.mtp_depth", f"the registry entries the launcher renders for torchtitan 0.3 build "
                           f"no multi-token prediction module (its deepseek_v3 has one only in "
                           f"deepseek_v3_debugmodel_mtp): the job would train none of the "
                           f"{spec.training.mtp_depth} MTP module(s) the plan prices.",
                           "set training.mtp_depth=0, or name a registry entry with MTP layers in trainer.args "
                           "(--module M --config C)."))
    if layout.cp > 1 and spec.stack.cp_comm.value == "p2p":
        out.append(Problem("stack.cp_comm", "torchtitan 0.3 has no rotate-method setting: its CP all-gathers K/V "
                           "(torch's default rotate method for SDPA, _context_parallel/_attention.py; flex_cp_allgather "
                           "for FlexAttention: torchtitan/distributed/context_parallel/api.py), not the ring (p2p).",
                           "set stack.cp_comm=all_gather, or trainer.version=0.2 (context_parallel_rotate_method="
                           "alltoall, torch's ring)."))
    if layout.ep > 1 and layout.etp != 1:
        out.append(Problem("layout.etp", f"torchtitan 0.3 runs experts with etp=1 (EP takes its ranks from "
                           f"dp_shard x cp x tp), got {layout.etp}.", "set layout.etp=1."))
    return out


def files(parts) -> dict[str, str]:
    return {}


def render(plan_json: dict, run_dir: Path, plan_dir: Path, par: dict, train: dict,
           parts: list[list[str]] | None) -> tuple[list[str], list[str]]:
    cfg = plan_json["config"]
    tr, t, lay = cfg["training"], cfg["trainer"], plan_json["layout"]
    out = []
    if not _given(t.get("args")):
        key = (cfg["model"]["name"], tr["precision"] == "fp8")
        if key not in CONFIGS:
            raise ValueError(f"[model, training.precision, trainer.args] torchtitan 0.3 has no registry entry for {key}")
        module, config = CONFIGS[key]
        out += ["--module", module, "--config", config]
    out += [f"--dump_folder={run_dir}"]
    par = {k: v for k, v in par.items() if k != "expert_tensor_parallel_degree"}
    out += [f"--parallelism.{k}={v}" for k, v in par.items()]
    if parts:
        out += ["--parallelism.module_fqns_per_model_part", *(",".join(p) for p in parts)]
    # config/configs.py CompileConfig (enable, components, enable_async_tensor_parallel), said either way:
    # registry entries turn compile on (llama3_405b_float8: model and loss)
    components, async_tp = compiled(cfg["stack"], lay["tp"])
    out += ["--compile.enable", f"--compile.components={','.join(components)}"] if components else \
        ["--compile.no-enable"]
    out.append("--compile.enable_async_tensor_parallel" if async_tp else "--compile.no-enable_async_tensor_parallel")
    out += [f"--training.{k}={v}" for k, v in train.items()] + [f"--debug.seed={tr['seed']}"]
    if lay["pp"] > 1 or lay["ep"] > 1:
        out.append("--training.disable_cuda_graphs")
    out += checkpoint_words(tr["checkpoint"], run_dir)
    return out, [AC[tr["recompute"]]]
