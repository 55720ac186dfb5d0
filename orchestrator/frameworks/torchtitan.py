"""torchtitan's command line from a plan, what torchtitan cannot run, and its rank order.

Checked against torchtitan==0.2.0 (PyPI; torchtitan/config/job_config.py, the JobConfig
dataclasses its tyro CLI parses: `--section.field value`, booleans as bare flags), by
tests/test_trainers.py when torchtitan is importable. Sources in that release:
  pp.py = torchtitan/distributed/pipeline_parallel.py (stage split, stages per rank)
  pd.py = torchtitan/distributed/parallel_dims.py (the device mesh: pp, dp_replicate,
          dp_shard, cp, tp outermost first; EP carved from dp_shard x cp [x tp])
  llama3 = torchtitan/models/llama3/infra/parallelize.py
"""
from __future__ import annotations

import math
from pathlib import Path

from orchestrator.config.errors import Problem
from orchestrator.config.schema import Config, Precision, Recompute
from orchestrator.config.schedules import SCHEDULES
from orchestrator.plan.layout import Layout

VERSION = "0.2.0"
STACKS = ("torchtitan",)
# torch.distributed.pipelining's get_schedule_class names, as torchtitan takes them
SCHEDULE_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B",
                  "zero_bubble": "InterleavedZeroBubble", "dualpipev": "DualPipeV"}
SINGLE_STAGE = ("GPipe", "1F1B")  # PipelineScheduleSingle: exactly one stage per rank (pp.py:94-99)
MESH = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # pd.py _build_mesh_without_ep, outermost first


def split(stages: int, layers: int, first_less: int, last_less: int) -> list[int] | None:
    """Layers per virtual stage as torchtitan's generate_llm_fqn_per_model_part deals them
    (pp.py:226-333): the embedding and the output count as `first_less` and `last_less`
    layers, the remainder goes to the first stages. None where torchtitan raises."""
    eff = layers + first_less + last_less
    per, extra = divmod(eff, stages) if stages else (0, 0)
    if stages > eff or per == 0 or first_less > per or last_less > per:
        return None
    out, cur = [], 0
    for i in range(stages):
        n = per + (1 if i < extra else 0) - (first_less if i == 0 else last_less if i == stages - 1 else 0)
        n = max(min(n, layers - cur), 0)
        out.append(n)
        cur += n
    return out if cur == layers else None


def stage_settings(plan_layers: list[int], pp: int, layers: int, schedule: str) -> dict | None:
    """The pipeline settings under which torchtitan splits the model as the plan does
    ({} for its defaults), or None when none does."""
    single = SCHEDULE_NAMES[schedule] in SINGLE_STAGE
    stages = len(plan_layers)
    for lps in [None] + list(range(1, layers + 3)):
        if lps is None:
            n = pp * (1 if single else 2)  # pp.py:108-113: the default stages per rank
        else:
            n = None  # set per (first, last) below
        for first in (1, 0, 2, 3):
            for last in (1, 0, 2, 3):
                count = n if lps is None else math.ceil((layers + first + last) / lps)  # pp.py:72-74
                if count != stages or count % pp or (single and count != pp) or (not single and count < 2 * pp):
                    continue
                if split(count, layers, first, last) == plan_layers:
                    out = {}
                    if first != 1:
                        out["pipeline_parallel_first_stage_less_layers"] = first
                    if last != 1:
                        out["pipeline_parallel_last_stage_less_layers"] = last
                    if lps is not None:
                        out["pipeline_parallel_layers_per_stage"] = lps
                    return out
    return None


def problems(spec: Config, layout: Layout) -> list[Problem]:
    out, tr = [], spec.training
    sched = layout.schedule.name
    if layout.pp > 1:
        if sched not in SCHEDULE_NAMES:
            out.append(Problem("schedule.name", f"torchtitan has no {sched} schedule (it runs torch's "
                               f"{sorted(SCHEDULE_NAMES.values())}).",
                               "use schedule=dualpipev (DualPipe's one-copy variant) or schedule=interleaved_1f1b."))
        elif sched == "zero_bubble":
            out.append(Problem("schedule.name", "torchtitan runs InterleavedZeroBubble (a multi-stage schedule) with "
                               "at least 2 stages per rank (pp.py:101-106); the plan's zero_bubble has one.",
                               "use schedule=dualpipev, or schedule=interleaved_1f1b layout.vp=2."))
        else:
            counts = [b - a for a, b in layout.virtual_stages()]
            if stage_settings(counts, layout.pp, spec.model.layers, sched) is None and spec.trainer.config_file:
                out.append(Problem("trainer.config_file, layout.stage_layers", f"torchtitan's own split settings "
                                   f"cannot give the plan's virtual stages {counts}, so the launcher writes them "
                                   f"as module_fqns_per_model_part in a config file of its own, and torchtitan "
                                   f"reads one config file.", "put the model and data settings in trainer.args "
                                   "(--model.flavor=..., --training.dataset=...) instead of trainer.config_file."))
    if layout.zero == 1:
        out.append(Problem("layout.zero", "torchtitan shards parameters, gradients and optimizer state together "
                           "(FSDP2) or nothing (DDP); zero=1 shards only the optimizer.",
                           "use layout.zero=2 (fsdp_reshard_after_forward=never) or 3."))
    if layout.zero == 0 and (layout.tp > 1 or layout.cp > 1 or layout.pp > 1):
        out.append(Problem("layout.zero", "torchtitan's DDP (zero=0) runs without TP, CP or PP "
                           "(llama3 parallelize: 'DDP has not supported > 1D parallelism').", "use layout.zero=2 or 3."))
    if layout.tp > 1 and not spec.layout.sequence_parallel:
        out.append(Problem("layout.sequence_parallel", "torchtitan always shards the sequence with TP.",
                           "set layout.sequence_parallel=true."))
    if layout.ep > 1 and layout.etp not in (1, layout.tp):
        out.append(Problem("layout.etp", f"torchtitan runs experts with etp=1 or etp=tp (pd.py), got {layout.etp}.",
                           "set layout.etp=1."))
    if tr.recompute == Recompute.full and tr.recompute_layers is not None:
        out.append(Problem("training.recompute_layers", "torchtitan recomputes every block (mode=full) or every "
                           "N-th (selective_ac_option=N), not the first N of each chunk.",
                           "unset training.recompute_layers."))
    if tr.precision in (Precision.mxfp8, Precision.nvfp4):
        out.append(Problem("training.precision", f"the rendering has no {tr.precision.value} arguments (it "
                           f"writes --model.converters=float8 for fp8).", "put torchtitan's MX converter "
                           "arguments in trainer.args with training.precision=fp8, or use trainer=command."))
    return out


def _counts(lay: dict) -> list[int]:
    """Layers per virtual stage, in pipeline order."""
    virtual = sorted((v for st in lay["stages"] for v in st["virtual"]), key=lambda v: v["stage"])
    return [v["layers"][1] - v["layers"][0] for v in virtual]


def module_parts(plan_json: dict) -> list[list[str]] | None:
    """The plan's split as torchtitan's module_fqns_per_model_part (tok_embeddings, layers.N,
    norm, output: the Llama module names), where its split settings cannot give it."""
    lay = plan_json["layout"]
    if lay["pp"] == 1 or lay["schedule"] not in SCHEDULE_NAMES:
        return None
    counts, layers = _counts(lay), plan_json["config"]["model"]["layers"]
    if stage_settings(counts, lay["pp"], layers, lay["schedule"]) is not None:
        return None
    out, start = [], 0
    for j, n in enumerate(counts):
        part = ["tok_embeddings"] if j == 0 else []
        part += [f"layers.{i}" for i in range(start, start + n)]
        out.append(part + (["norm", "output"] if j == len(counts) - 1 else []))
        start += n
    return out


def config_toml(parts: list[list[str]]) -> str:
    """The config file the launcher writes beside the plan when the split needs module names."""
    rows = ",\n  ".join("[" + ", ".join(f'"{m}"' for m in p) + "]" for p in parts)
    return f"# written by orchestrator from plan.json: the plan's pipeline split\n[parallelism]\n" \
           f"module_fqns_per_model_part = [\n  {rows}\n]\n"


def env(plan_json: dict) -> dict[str, str | None]:
    """torchtitan needs nothing in the rank's environment beyond torchrun's."""
    return {}


def files(plan_json: dict) -> dict[str, str]:
    """The files the command line names, written beside the plan: torchtitan.toml for a split
    that only module names express."""
    parts = module_parts(plan_json)
    return {"torchtitan.toml": config_toml(parts)} if parts else {}


def render(plan_json: dict, run_dir: Path, plan_dir: Path | None = None) -> list[str]:
    """torchtitan's CLI overrides for this plan (after trainer.command, before trainer.args);
    with a split only module names express, they point at PLAN_DIR/torchtitan.toml."""
    plan_dir = plan_dir or run_dir
    lay, cfg = plan_json["layout"], plan_json["config"]
    tr, t = cfg["training"], cfg["trainer"]
    pp, dp, zero = lay["pp"], lay["dp"], lay["zero"]
    shard, repl = (1, dp) if zero == 0 else (lay["dp_shard"], lay["dp_replicate"])
    par = {"data_parallel_replicate_degree": repl, "data_parallel_shard_degree": shard,
           "tensor_parallel_degree": lay["tp"], "context_parallel_degree": lay["cp"],
           "pipeline_parallel_degree": pp, "expert_parallel_degree": lay["ep"]}
    if lay["ep"] > 1:
        par["expert_tensor_parallel_degree"] = lay["etp"]
    if zero >= 2:
        par["fsdp_reshard_after_forward"] = "never" if zero == 2 else "default"
    if pp > 1:
        counts = _counts(lay)
        par["pipeline_parallel_schedule"] = SCHEDULE_NAMES[lay["schedule"]]
        par["pipeline_parallel_microbatch_size"] = lay["micro_batch"]
        par.update(stage_settings(counts, pp, cfg["model"]["layers"], lay["schedule"]) or {})
    parts = module_parts(plan_json)
    config_file = f"{plan_dir}/torchtitan.toml" if parts else t.get("config_file")
    out = [f"--job.config_file={config_file}"] if config_file else []
    out += [f"--job.dump_folder={run_dir}"]
    out += [f"--parallelism.{k}={v}" for k, v in par.items()]
    local = tr["global_batch"] // dp if pp > 1 else lay["micro_batch"]
    out += [f"--training.local_batch_size={local}", f"--training.global_batch_size={tr['global_batch']}",
            f"--training.seq_len={tr['seq_len']}", f"--training.steps={tr['steps']}", f"--training.seed={tr['seed']}",
            f"--training.mixed_precision_param={'float32' if tr['precision'] == Precision.fp32.value else 'bfloat16'}"]
    if tr["precision"] == Precision.fp8.value:
        out.append("--model.converters=float8")
    out.append(f"--activation_checkpoint.mode={tr['recompute']}")
    if tr["recompute"] == Recompute.selective.value:
        out.append("--activation_checkpoint.selective_ac_option=op")
    ck = tr["checkpoint"]
    if ck["every"] > 0:
        folder = (ck["dir"] or f"{run_dir}/checkpoints").removeprefix("file://")
        out += ["--checkpoint.enable", f"--checkpoint.folder={folder}", f"--checkpoint.interval={ck['every']}",
                f"--checkpoint.keep_latest_k={ck['keep']}"]
    return out


def framework_rank(coords: dict, plan_json: dict) -> int:
    """The RANK whose coordinates in torchtitan's mesh (MESH, row-major over RANK as
    init_device_mesh lays it out) are these plan coordinates (dp = replicate x shard)."""
    lay = plan_json["layout"]
    shard = 1 if lay["zero"] == 0 else lay["dp_shard"]
    repl = lay["dp"] // shard
    idx = {"pp": coords["pp"], "dp_replicate": coords["dp"] // shard, "dp_shard": coords["dp"] % shard,
           "cp": coords["cp"], "tp": coords["tp"]}
    size = {"pp": lay["pp"], "dp_replicate": repl, "dp_shard": shard, "cp": lay["cp"], "tp": lay["tp"]}
    r = 0
    for d in MESH:
        r = r * size[d] + idx[d]
    return r


def expert_groups(plan_json: dict) -> list[list[int]]:
    """torchtitan's expert-parallel groups, in RANKs (pd.py _build_mesh_with_ep): dp_shard
    splits into mod_ep x in_ep and ep flattens in_ep, cp and (with etp=1) tp."""
    import numpy as np

    lay = plan_json["layout"]
    tp, cp, ep, etp, shard = lay["tp"], lay["cp"], lay["ep"], lay["etp"], lay["dp_shard"]
    inner = ep // cp if etp == tp else ep // (cp * tp)
    cube = np.arange(lay["pp"] * lay["dp"] * cp * tp).reshape(lay["pp"], lay["dp"] // shard, shard // inner, inner, cp, tp)
    axes = [3, 4] if etp == tp else [3, 4, 5]  # each group: ep ranks
    rest = [i for i in range(6) if i not in axes]
    return np.transpose(cube, rest + axes).reshape(-1, ep).tolist()


assert set(SCHEDULE_NAMES) <= set(SCHEDULES)
