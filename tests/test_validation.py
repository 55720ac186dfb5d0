"""Validation: published layouts pass, bad ones fail with their own clear error."""
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ROOT, plan_of
from orchestrator.plan import PlanError, make_plan
from orchestrator.published.calibrate import load_rows

L405 = ["hardware=h100_sxm", "model=llama3_405b", "training.seq_len=8192", "training.global_batch=2048",
        "schedule=interleaved_1f1b", "layout.vp=7", "layout.zero=2",
        "layout.stage_layers=[7,8,8,8,8,8,8,8,8,8,8,8,8,8,8,7]"]


def test_llama3_405b_8k_validates():
    # Meta's own stack: this runtime under torch's pipelining keeps FSDP2's gradients unsharded until the
    # last micro-batch (tests/test_step_bytes.py), 5.9 GiB more on this layout, which then does not fit
    plan = plan_of(*L405, "stack=llama3_meta", "cluster.nodes=1024", "layout.tp=8", "layout.cp=1", "layout.pp=16",
                   "layout.dp=64")
    assert plan.valid, plan.errors
    assert plan.memory.fits


def test_long_context_row_as_sometimes_printed_is_rejected():
    plan = plan_of(*L405, "cluster.nodes=2048", "training.seq_len=131072", "training.global_batch=128",
                   "layout.tp=8", "layout.cp=16", "layout.pp=16", "layout.dp=4")
    assert not plan.valid
    msg = " ".join(str(e) for e in plan.errors)
    assert "= 8192 != WORLD_SIZE 16384" in msg
    assert "dp=8 would fit" in msg


def test_megatron_1t_validates():
    plan = plan_of("recipe=megatron_1t")
    assert plan.valid, plan.errors
    assert (plan.layout.tp, plan.layout.pp, plan.layout.dp, plan.world_size) == (8, 64, 6, 3072)


@pytest.mark.parametrize("row", load_rows(), ids=lambda r: r.name[:40])
def test_every_published_layout_fits_in_memory(row):
    """Each published run ran, so it must plan as fitting with its documented settings."""
    from orchestrator import compose

    plan = make_plan(compose(row.overrides))
    assert plan.valid, [str(e) for e in plan.errors]
    assert plan.memory.fits


def test_recompute_changes_memory_and_hfu():
    base = ["model=llama3_70b", "cluster.nodes=8", "layout.tp=8", "layout.pp=4", "training.seq_len=8192",
            "training.global_batch=64"]
    none, sel, full = (plan_of(*base, f"training.recompute={r}") for r in ("none", "selective", "full"))
    assert none.memory.activations > sel.memory.activations > full.memory.activations
    # Recompute counts as hardware FLOPs, not model FLOPs: HFU rises, MFU falls.
    assert none.hfu == pytest.approx(none.mfu) and sel.hfu > none.hfu
    assert full.hfu == pytest.approx(full.mfu * 4 / 3, rel=0.03)  # one more forward: 8N instead of 6N
    assert none.mfu > sel.mfu > full.mfu  # the same model FLOPs take longer


def test_attention_flops_can_be_left_out():
    base = ["model=llama3_8b", "cluster.nodes=1", "layout.tp=8", "training.seq_len=32768", "training.global_batch=8"]
    with_attn = plan_of(*base)
    without = plan_of(*base, "cost.attention_flops=false")
    assert with_attn.model_flops_per_step > without.model_flops_per_step
    assert without.model_flops_per_step == pytest.approx(6 * without.params * 8 * 32768)


INVALID = [
    # (overrides, key that must be named, words that must appear)
    (["cluster.nodes=2", "layout.tp=8", "layout.dp=4"], "layout.dp, cluster.nodes", "dp=2 would fit"),
    (["cluster.nodes=3", "layout.tp=8", "layout.pp=2"], "layout.tp, layout.cp, layout.pp, cluster.nodes",
     "does not divide"),
    (["model=llama3_70b", "cluster.nodes=4", "layout.tp=16"], "layout.tp", "allow_cross_node_tp"),
    (["model=llama3_8b", "cluster.nodes=2", "layout.tp=3", "hardware.gpus_per_node=6"], "layout.tp, model.heads",
     "32 attention heads"),
    (["model=llama3_8b", "model.kv_heads=6", "model.heads=36", "cluster.nodes=1", "layout.tp=4"],
     "layout.tp, model.kv_heads", "KV heads"),
    (["model=llama3_8b", "cluster.nodes=3", "layout.pp=3"], "layout.pp, layout.vp, model.layers",
     "does not split"),
    (["model=llama3_8b", "cluster.nodes=1", "layout.tp=2", "layout.cp=4", "training.seq_len=4100"],
     "training.seq_len, layout.cp", "2 x cp = 8"),
    (["model=llama3_8b", "cluster.nodes=1", "layout.tp=8", "training.global_batch=1001", "layout.dp=1",
      "training.micro_batch=2"], "training.global_batch, layout.dp, training.micro_batch", "not a multiple"),
    (["model=llama3_8b", "cluster.nodes=4", "layout.tp=8", "layout.pp=4", "training.global_batch=2"],
     "schedule.name, training.global_batch, layout.pp", "at least pp=4"),
    # Megatron's interleaving runs micro-batches in groups of pp (schedules.py:1160-1180) ...
    (["model=llama3_8b", "cluster.nodes=4", "layout.tp=8", "layout.pp=4", "training.global_batch=6",
      "schedule=interleaved_1f1b", "layout.vp=2", "stack=megatron_core"],
     "schedule.name, training.global_batch, layout.pp", "multiple of pp=4"),
    # ... torch's in max(1, m // pp) rounds (ScheduleInterleaved1F1B): 6 runs there, 9 does not
    (["model=llama3_8b", "cluster.nodes=4", "layout.tp=8", "layout.pp=4", "training.global_batch=9",
      "schedule=interleaved_1f1b", "layout.vp=2"], "schedule.name, training.global_batch, layout.pp",
     "not a multiple of 2"),
    (["model=llama3_8b", "cluster.nodes=1", "schedule=interleaved_1f1b", "layout.vp=4", "layout.pp=1"],
     "layout.vp, layout.pp", "layout.vp=1"),
    (["model=llama3_8b", "cluster.nodes=1", "schedule=interleaved_1f1b", "layout.vp=4", "layout.pp=1",
      "stack=megatron_core"], "layout.vp, layout.pp", "pp > 1"),
    (["model=llama3_8b", "cluster.nodes=2", "layout.pp=2", "layout.vp=2"], "layout.vp, schedule.name",
     "interleaved"),
    (["model=llama3_405b", "cluster.nodes=2", "layout.tp=8", "training.seq_len=8192"],
     "hardware.gpu_memory_gb, training.recompute, layout", "GiB"),
    (["model=llama3_8b", "layout.ep=2", "cluster.nodes=1"], "layout.ep, model.moe.experts", "dense"),
    (["model=llama3_8b", "layout.order=[tp,xx,dp]"], "layout.order", "[1]='xx': not an axis name"),
    (["model=llama3_8b", "layout.order=[tp,dp,tp]"], "layout.order", "[2]='tp': named before"),
    (["model=llama3_8b", "layout.dp=many"], "layout.dp", "positive integer or 'auto'"),
    (["model=llama3_8b", "cluster.nodes=0"], "cluster.nodes", "must be positive"),
    (["model=llama3_8b", "training.max_norm=-1"], "training.max_norm", "0 <= training.max_norm"),
    (["model=llama3_8b", "training.max_norm=nan"], "training.max_norm", "got nan"),
    (["model=llama3_8b", "cluster.nodes=4", "layout.pp=4", "layout.stage_layers=[8,8,8]"],
     "layout.stage_layers", "it has 3 entries, layout.pp=4 stages need one each"),
    (["model=llama3_8b", "cluster.nodes=2", "layout.ep=1", "model.moe.experts=8", "model.moe.experts_per_token=2",
      "model.moe.expert_ffn_hidden=1024", "layout.ep=16", "layout.tp=8", "layout.etp=8"],
     "layout.ep, layout.etp", "expert grid"),
]


def test_a_closed_choice_is_refused_at_compose_time_naming_the_key():
    """Typed config: an unknown schedule never reaches the planner."""
    from orchestrator import compose
    from orchestrator.config.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        compose(["model=llama3_8b", "schedule.name=magic"])
    (p,) = err.value.problems
    assert p.key == "schedule.name" and "magic" in p.message and "interleaved_1f1b" in p.fix


@pytest.mark.parametrize("overrides,key,words", INVALID, ids=[i[1] + ":" + i[2] for i in INVALID])
def test_invalid_configuration_has_its_own_clear_error(overrides, key, words):
    plan = plan_of(*overrides)
    assert not plan.valid
    hits = [e for e in plan.errors if e.key == key]
    assert hits, [str(e) for e in plan.errors]
    assert any(words in e.message + e.fix for e in hits), [str(e) for e in hits]
    assert all(e.fix for e in plan.errors), "every error says what to do"
    with pytest.raises(PlanError):
        plan.raise_if_invalid()


LIST_ENTRIES = [  # a list refused for some of its entries: those entries, by index and value, and a fix that runs
    (L405 + ["cluster.nodes=1024", "layout.tp=8", "layout.pp=16", "layout.vp=8"], "[0]=7, [15]=7 are below 8"),
    (L405 + ["cluster.nodes=1024", "layout.tp=8", "layout.pp=16", "layout.vp=2",
             "layout.stage_layers=[1,8,8,8,8,8,8,8,8,8,8,8,8,8,8,13]"], "[0]=1 is below 2"),
    (L405 + ["cluster.nodes=1024", "layout.tp=8", "layout.pp=16", "layout.stage_layers=[7,8,8]"], "3 entries"),
    (["model=tiny", "hardware=cpu", "cluster.nodes=1", "hardware.gpus_per_node=2", "layout.pp=2",
      "schedule=interleaved_1f1b", "layout.vp=8", "layout.stage_layers=[2,2]"], "[0]=2, [1]=2 are below 8"),
]


@pytest.mark.parametrize("overrides,named", LIST_ENTRIES, ids=[n for _, n in LIST_ENTRIES])
def test_stage_layers_names_the_entries_and_its_fix_plans(overrides, named):
    import re

    plan = plan_of(*overrides)
    (e,) = [e for e in plan.errors if e.key == "layout.stage_layers"]
    assert named in e.message, str(e)
    fix = re.findall(r"(layout\.(?:vp|stage_layers)=(?:\[[\d,]+\]|\d+))", e.fix)
    assert any(f.startswith("layout.stage_layers=") for f in fix), str(e)
    fixed = plan_of(*overrides, *fix)  # what the fix says, planned: no complaint about the split is left
    assert not [x for x in fixed.errors if "stage_layers" in x.key or "layout.vp" in x.key], fixed.errors


def test_other_lists_name_their_entries():
    from orchestrator import compose
    from orchestrator.config.compose import typed
    from orchestrator.launch.preflight import fault_problems

    from orchestrator.launch.preflight import allow_problems

    problems = allow_problems(typed(compose(["training.resume.allow=[model.rope_theta,training.sed,nope]"])))
    named = {e.key: e for e in problems}
    assert sorted(named) == ["training.resume.allow[1]", "training.resume.allow[2]"], problems
    assert named["training.resume.allow[1]"].fix == "did you mean training.seed?"
    assert "'nope'" in named["training.resume.allow[2]"].message and "training.seed" in named["training.resume.allow[2]"].fix
    plan = plan_of("+fabric.tiers=[{name:rack,size:8,gbps:50,latency_us:2},{name:pod,size:0,gbps:25,latency_us:-1}]")
    (e,) = [e for e in plan.errors if e.key.startswith("fabric.tiers")]
    assert e.key == "fabric.tiers[1]" and "size=0, latency_us=-1" in e.message, str(e)
    spec = typed(compose(["hardware=cpu", "model=tiny", "cluster.nodes=4", "fault.kind=kill_node", "fault.at_step=2",
                          "fault.kill_node=[1,7,1]", "training.steps=5"]))
    (e,) = [p for p in fault_problems(spec) if p.key == "fault.kill_node"]
    assert "[1]=7 is not a node of 0 .. 3" in e.message and "[2]=1 named before" in e.message, str(e)
    spec = typed(compose(["hardware=cpu", "model=tiny", "cluster.nodes=2", "layout.dp=2", "layout.dp_shard=1",
                          "fault.kind=cut_copy", "fault.rank=1", "fault.at_step=2", "training.steps=5"]))
    (e,) = [p for p in fault_problems(spec) if p.key == "fault.kind"]  # two copies: which one is cut is unknowable
    assert "holds 2 copies" in e.message and "at least 3 copies" in e.fix, str(e)


def test_errors_are_collected_not_only_the_first():
    plan = plan_of("model=llama3_8b", "cluster.nodes=3", "layout.tp=3", "training.seq_len=4097", "layout.cp=2")
    assert len(plan.errors) >= 2


def test_cli_rejects_with_exit_2_and_no_traceback(cli):
    r = cli("model=llama3_70b", "cluster.nodes=4", "layout.tp=16")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr + r.stdout
    assert "layout.tp" in r.stderr and "nothing was launched" in r.stderr


@pytest.mark.parametrize("value", ["hardware.intra_node_latency_us=???", "model.norm_eps=${nope}"])
def test_cli_rejects_a_value_that_makes_no_config_with_exit_2(cli, value):
    """Found by benchmarks/fuzz_plans.py: these passed compose and broke after planning (exit 1)."""
    r = cli("recipe=megatron_1t", value, "figures=false")
    assert r.returncode == 2, r.stderr
    assert "internal error" not in r.stderr + r.stdout and value.split("=")[0] in r.stderr


def test_cli_refuses_a_boolean_given_a_number_with_exit_2(cli):
    """OmegaConf would take 3 for true and 0 for false without a word: the schema's booleans take
    true or false (a launcher's too), every one named with its value."""
    r = cli("stack.grad_clip=3", "layout.sequence_parallel=0", "launcher=slurm", "launcher.submit=1", "figures=false")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr + r.stdout and "nothing was launched" in r.stderr
    for key, value in (("stack.grad_clip", "3"), ("layout.sequence_parallel", "0"), ("launcher.submit", "1")):
        assert f"[{key}] is a boolean, got {value}." in r.stderr and f"{key}=true or {key}=false" in r.stderr, key


def test_a_boolean_in_a_preset_or_a_mapping_takes_true_or_false_only(tmp_path):
    from orchestrator import compose
    from orchestrator.config.compose import typed
    from orchestrator.config.errors import ConfigError

    (tmp_path / "layout").mkdir()
    (tmp_path / "layout" / "mine.yaml").write_text("tp: 2\nsequence_parallel: 2\n")
    with pytest.raises(ConfigError) as err:  # a site's preset (--config-dir), as written in its file
        compose(["layout=mine", "layout.sequence_parallel=on"], config_dir=str(tmp_path))
    assert [(p.key, p.message) for p in err.value.problems] == [
        ("layout.sequence_parallel", "is a boolean, got 'on'."),
        ("layout.sequence_parallel", "is a boolean, got 2 in the preset layout=mine.")]
    with pytest.raises(ConfigError) as err:  # a plain mapping (plan.json's config)
        typed({"stack": {"grad_clip": 0}})
    assert [p.key for p in err.value.problems] == ["stack.grad_clip"]
    assert compose(["stack.grad_clip=false", "layout.sequence_parallel=TRUE"]).stack.grad_clip is False


def test_cli_misspelled_key_names_the_key(cli):
    r = cli("layout.tpp=8")
    assert r.returncode != 0
    assert "tpp" in r.stderr and "Traceback" not in r.stderr


def test_cli_wrong_type_names_the_key(cli):
    r = cli("layout.tp=eight")
    assert r.returncode != 0
    assert "layout.tp" in r.stderr and "Traceback" not in r.stderr


def test_dry_run_of_a_large_config_does_not_import_torch(tmp_path):
    code = (
        "import sys; sys.argv = ['orchestrate', 'recipe=llama3_405b', 'hydra.run.dir=%s'];\n"
        "from orchestrator.cli import main\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "assert 'torch' not in sys.modules, 'the planning path imported torch'\n"
        "print('NO_TORCH_OK')\n" % (tmp_path / "run")
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "NO_TORCH_OK" in r.stdout
    assert (tmp_path / "run" / "plan.json").exists()


# ---- property test: any input gives a plan or the project's own rejection, never a traceback ----
def _cfg(d):
    return {
        "hardware": {"name": "h", "gpus_per_node": d["gpn"], "gpu_memory_gb": d["mem"], "peak_tflops": 989.0,
                     "intra_node_gbps": 450.0, "inter_node_gbps": 50.0},
        "cluster": {"nodes": d["nodes"]},
        "model": {"name": "m", "layers": d["layers"], "hidden": d["heads"] * d["hd"], "ffn_hidden": d["ffn"],
                  "heads": d["heads"], "kv_heads": d["kv"], "vocab": d["vocab"], "mlp": d["mlp"],
                  "tied_embeddings": d["tied"]},
        "training": {"seq_len": d["seq"], "global_batch": d["gb"], "micro_batch": d["mb"],
                     "recompute": d["rec"], "flash_attention": d["flash"]},
        "layout": {"tp": d["tp"], "cp": d["cp"], "pp": d["pp"], "dp": d["dp"], "vp": d["vp"], "zero": d["zero"],
                   "order": d["order"], "allow_cross_node_tp": d["xtp"]},
        "schedule": {"name": d["sched"]},
    }


ints = lambda lo, hi: st.integers(min_value=lo, max_value=hi)  # noqa: E731
pow2 = st.sampled_from([1, 2, 4, 8, 16, 32])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.fixed_dictionaries({
    "gpn": st.sampled_from([1, 2, 4, 6, 8, 16]), "mem": st.sampled_from([0.5, 16.0, 80.0, 141.0]),
    "nodes": ints(-1, 300), "layers": ints(0, 130), "heads": ints(0, 64), "hd": st.sampled_from([16, 64, 128]),
    "ffn": ints(0, 30000), "kv": ints(0, 16), "vocab": ints(0, 130000), "mlp": st.sampled_from(["swiglu", "gelu"]),
    "tied": st.booleans(), "seq": ints(0, 140000), "gb": ints(0, 5000), "mb": ints(0, 8),
    "rec": st.sampled_from(["none", "selective", "full"]), "flash": st.booleans(),
    "tp": pow2, "cp": pow2, "pp": st.sampled_from([1, 2, 3, 4, 8, 16, 64]),
    "dp": st.one_of(st.just("auto"), ints(-2, 256)), "vp": ints(0, 4), "zero": ints(-1, 4),
    "order": st.sampled_from(["auto", "tp-cp-ep-dp-pp", ["dp", "tp", "pp", "cp"], ["tp", "cp", "pp", "dp"]]),
    "xtp": st.booleans(),
    "sched": st.sampled_from(["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "dualpipe", "nope"]),
}))
def test_property_any_input_plans_or_is_rejected_cleanly(d):
    try:
        plan = make_plan(_cfg(d))
    except PlanError:  # the project's own error is the only acceptable exception
        return
    if plan.valid:
        assert plan.step.total_s > 0 and 0 < plan.mfu <= 1.0 + 1e-9
        assert plan.memory.fits
        assert plan.layout.tp * plan.layout.cp * plan.layout.pp * plan.layout.dp == plan.world_size
    else:
        assert plan.errors and all(e.key and e.message for e in plan.errors)
