"""torchtitan 0.2 (torchtitan==0.2.0 on PyPI): JobConfig dataclasses (torchtitan/config/job_config.py)
parsed by tyro, `--section.field value`, booleans as bare flags; the model from
`--model.name/--model.flavor`, `--job.config_file` or trainer.args; a split only module names
express goes in a TOML file (`[parallelism] module_fqns_per_model_part`) named by
`--job.config_file`; the last module is `output`. With CP, `--parallelism.context_parallel_rotate_method`
(job_config.py: allgather | alltoall), which torchtitan hands torch's set_rotate_method
(torchtitan/distributed/utils.py create_context_parallel_ctx): torch's "allgather" all-gathers the K/V
shards (stack.cp_comm=all_gather), its "alltoall" passes each shard to the next rank of the ring,
overlapped with the block's attention (torch/distributed/tensor/experimental/_context_parallel/
_attention.py _AllToAllRotater: permute_tensor to rank + 1), which is stack.cp_comm=p2p."""
from __future__ import annotations

from pathlib import Path

from orchestrator.config.errors import Problem
from orchestrator.frameworks.torchtitan.common import checkpoint_words, compiled
from orchestrator.config.schema import Config

LINE = "0.2"
RELEASE = "0.2.0"  # the release the tests run (tests/frameworks.py)
OUTPUT = "output"  # the output projection's module name (torchtitan/models/llama3/model/model.py)
# our model -> (train spec, flavor) in torchtitan/models/<name>/__init__.py (llama3_configs, deepseekv3_configs)
ROTATE = {"all_gather": "allgather", "p2p": "alltoall"}  # stack.cp_comm -> context_parallel_rotate_method
MODELS = {"llama3_8b": ("llama3", "8B"), "llama3_70b": ("llama3", "70B"), "llama3_405b": ("llama3", "405B"),
          "deepseek_v3": ("deepseek_v3", "671B")}


def problems(spec: Config, layout, module_names_needed: bool) -> list[Problem]:
    out = []
    if spec.training.mtp_depth > 0:
        out.append(Problem("training.mtp_depth", f"torchtitan 0.2 has no multi-token prediction module (its "
                           f"deepseek_v3 trains the main model only): the job would train none of the "
                           f"{spec.training.mtp_depth} MTP module(s) the plan prices.",
                           "set training.mtp_depth=0, or use torchtitan 0.3 (trainer.version=0.3) with a registry "
                           "entry that has MTP layers."))
    if module_names_needed and spec.trainer.config_file:
        out.append(Problem("trainer.config_file, layout.stage_layers", "torchtitan 0.2's own split settings cannot "
                        "give the plan's virtual stages, so the launcher writes them as module_fqns_per_model_part "
                        "in a config file of its own, and torchtitan reads one config file.",
                        "put the model and data settings in trainer.args (--model.flavor=..., "
                        "--training.dataset=...) instead of trainer.config_file."))
    return out


def config_toml(parts: list[list[str]]) -> str:
    """The config file the launcher writes beside the plan when the split needs module names."""
    rows = ",\n  ".join("[" + ", ".join(f'"{m}"' for m in p) + "]" for p in parts)
    return f"# written by orchestrator from plan.json: the plan's pipeline split\n[parallelism]\n" \
           f"module_fqns_per_model_part = [\n  {rows}\n]\n"


def files(parts: list[list[str]] | None) -> dict[str, str]:
    return {"torchtitan.toml": config_toml(parts)} if parts else {}


def render(plan_json: dict, run_dir: Path, plan_dir: Path, par: dict, train: dict,
           parts: list[list[str]] | None) -> tuple[list[str], list[str]]:
    """(the overrides after trainer.command, the words after trainer.args: none in 0.2)."""
    cfg = plan_json["config"]
    tr, t = cfg["training"], cfg["trainer"]
    config_file = f"{plan_dir}/torchtitan.toml" if parts else t.get("config_file")
    out = [f"--job.config_file={config_file}"] if config_file else []
    given = " ".join(t.get("args") or [])
    if not t.get("config_file") and "--model.name" not in given and cfg["model"]["name"] in MODELS:
        name, flavor = MODELS[cfg["model"]["name"]]
        out += [f"--model.name={name}", f"--model.flavor={flavor}"]
    out += [f"--job.dump_folder={run_dir}"]
    out += [f"--parallelism.{k}={v}" for k, v in par.items()]
    if plan_json["layout"]["cp"] > 1:  # the method the plan priced (a2a: refused by problems)
        out.append(f"--parallelism.context_parallel_rotate_method={ROTATE[cfg['stack']['cp_comm']]}")
    # job_config.py Compile (enable, components) and Parallelism.enable_async_tensor_parallel, said either
    # way: a config file or trainer.args may have turned them on
    parts, async_tp = compiled(cfg["stack"], plan_json["layout"]["tp"])
    out += ["--compile.enable", "--compile.components", *parts] if parts else ["--compile.no-enable"]
    out.append("--parallelism.enable_async_tensor_parallel" if async_tp else
               "--parallelism.no-enable_async_tensor_parallel")
    out += [f"--training.{k}={v}" for k, v in train.items()] + [f"--training.seed={tr['seed']}"]
    if tr["precision"] == "fp8":
        out.append("--model.converters=float8")
    out.append(f"--activation_checkpoint.mode={tr['recompute']}")
    if tr["recompute"] == "selective":
        out.append("--activation_checkpoint.selective_ac_option=op")
    out += checkpoint_words(tr["checkpoint"], run_dir)
    return out, []
