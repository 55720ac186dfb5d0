"""torchtitan 0.3 (torchtitan==0.3.0 on PyPI): a config registry per model, chosen with
`--module M --config C` (torchtitan/config/manager.py ConfigManager._load_config; the functions
of torchtitan/models/<M>/config_registry.py), then tyro overrides of the Trainer.Config
dataclasses (torchtitan/trainer.py, torchtitan/config/configs.py): `--section.field value`,
booleans as bare flags, `--dump_folder` at the top, the seed in `--debug.seed`, no config file;
a split only module names express goes in `--parallelism.module_fqns_per_model_part A,B C,D`
(one comma-separated word per part); the last module is `lm_head`. Activation checkpointing is
a tyro subcommand (`activation-checkpoint:full|selective|none`) and, as a subcommand, comes
after every other option, so after trainer.args. Trainer.Config.__post_init__ refuses pipeline
parallelism, and expert parallelism with its default token dispatcher, unless
`--training.disable_cuda_graphs` is given. No expert_tensor_parallel_degree: EP takes its ranks
from dp_shard x cp x tp, innermost (torchtitan/distributed/parallel_dims.py, the sparse mesh
pp, dp_replicate, efsdp, ep), i.e. etp=1."""
from __future__ import annotations

from pathlib import Path

from orchestrator.config.errors import Problem
from orchestrator.config.schema import Config

LINE = "0.3"
RELEASE = "0.3.0"
OUTPUT = "lm_head"  # torchtitan/distributed/pipeline_parallel.py _generate_llm_fqn_per_model_part
# our model -> (--module, --config): functions of torchtitan/models/<module>/config_registry.py
MODELS = {"llama3_8b": ("llama3", "llama3_8b"), "llama3_70b": ("llama3", "llama3_70b"),
          "llama3_405b": ("llama3", "llama3_405b"), "deepseek_v3": ("deepseek_v3", "deepseek_v3_671b")}
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
    if spec.model.name not in MODELS and not _given(spec.trainer.args):
        out.append(Problem("model, trainer.args", f"torchtitan 0.3 trains a model from its config registry; "
                           f"{spec.model.name} has no entry the launcher knows ({sorted(MODELS)}).",
                           "put its registry entry in trainer.args, e.g. 'trainer.args=[--module, llama3, "
                           "--config, llama3_debugmodel]', or use model= one of those."))
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
        if cfg["model"]["name"] not in MODELS:
            raise ValueError(f"[model, trainer.args] torchtitan 0.3 needs --module/--config for {cfg['model']['name']}")
        module, config = MODELS[cfg["model"]["name"]]
        out += ["--module", module, "--config", config]
    out += [f"--dump_folder={run_dir}"]
    par = {k: v for k, v in par.items() if k != "expert_tensor_parallel_degree"}
    out += [f"--parallelism.{k}={v}" for k, v in par.items()]
    if parts:
        out += ["--parallelism.module_fqns_per_model_part", *(",".join(p) for p in parts)]
    out += [f"--training.{k}={v}" for k, v in train.items()] + [f"--debug.seed={tr['seed']}"]
    if lay["pp"] > 1 or lay["ep"] > 1:
        out.append("--training.disable_cuda_graphs")
    ck = tr["checkpoint"]
    if ck["every"] > 0:
        folder = (ck["dir"] or f"{run_dir}/checkpoints").removeprefix("file://")
        out += ["--checkpoint.enable", f"--checkpoint.folder={folder}", f"--checkpoint.interval={ck['every']}",
                f"--checkpoint.keep_latest_k={ck['keep']}"]
    return out, [AC[tr["recompute"]]]
