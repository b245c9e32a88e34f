"""`hfsdp plan`: a 70B Llama on 1,024 x 8 GPUs against figures computed by hand, the bad inputs, speed, no torch."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hfsdp.cli.main import app

#: Llama 3 70B's config.json fields that fix its shapes.
LLAMA_70B = {
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
}
NODES, GPUS, SEQ = 1024, 8, 4096
PLAN_70B = ["--nodes", str(NODES), "--seq-len", str(SEQ), "--micro-batch-size", "1", "--dtype", "bf16", "--recompute"]


@pytest.fixture(scope="module")
def llama_70b(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama70b") / "config.json"
    path.write_text(json.dumps(LLAMA_70B))
    return path


@pytest.fixture(scope="module")
def plan_70b(llama_70b) -> dict:
    result = CliRunner().invoke(app, ["plan", "--model-config", str(llama_70b), *PLAN_70B, "--format", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def _by_name(plan: dict, name: str) -> dict:
    (row,) = [r for r in plan["layouts"] if r["layout"] == name]
    return row


def _hand_70b():
    """The Llama's counts written out from its modules: per layer two RMSNorm weights, q/k/v/o, gate/up/down."""
    h, f, layers, heads, kv, vocab = 8192, 28672, 80, 64, 8, 128256
    head = h // heads
    layer = 2 * h + (h * h + 2 * kv * head * h + h * h) + 3 * h * f
    root = vocab * h + h + vocab * h  # embed_tokens, norm, lm_head (untied)
    return h, f, layers, heads, kv, vocab, head, layer, root


def test_70b_parameter_count_is_the_llama_formula(plan_70b):
    """70.55B: 80 layers of 855,654,400 and a root of 2,101,354,496 parameters."""
    _, _, layers, *_, layer, root = _hand_70b()
    assert (layer, root) == (855_654_400, 2_101_354_496)
    assert plan_70b["model"]["parameters"] == layers * layer + root


@pytest.mark.parametrize(("name", "param_shards", "optim_shards", "grad_shards"), [
    ("ZeRO-3 1x8192", 8192, 8192, 8192),
    ("HFSDP 1024x8", 8, 8192, 8),
])  # fmt: skip
def test_70b_memory_matches_hand_computed_figures(plan_70b, name, param_shards, optim_shards, grad_shards):
    """Model state per rank from formulas.md's rules (bf16 shard only where s_p != s_o, fp32 main weights and Adam's
    two moments over s_o, fp32 gradients over the inner shard) and the backward-phase peak from docs/planning.md's
    terms, computed here by hand, equal the plan's bytes exactly."""
    h, f, layers, heads, kv, _vocab, head, layer, root = _hand_70b()
    world, c, tokens = NODES * GPUS, 2, SEQ  # bf16; one sequence per microbatch
    for numel in (layer, root):
        assert numel % world == 0  # these sizes need no padding: every piece below is exact
    psi = layers * layer + root
    row = _by_name(plan_70b, name)
    memory = row["memory_bytes"]
    assert memory["params"] == (c * psi // param_shards if param_shards != optim_shards else 0)
    assert memory["optimizer"] == (4 + 8) * psi // optim_shards
    assert memory["grads"] == 4 * psi // grad_shards  # two microbatches: the buffers exist at every peak
    # The peak is the last layer's backward: every layer's input (recompute), the recomputed layer's activations and
    # MLP workspace, the gathered root and last two layers, that layer's gradients and the flat buffer it reduces.
    assert memory["peak_at"] == "backward"
    q, kvd = heads * head, kv * head
    full_layer = 2 * ((4 + 2 * c) * tokens * h + 4 * tokens) + c * tokens * (2 * q + 2 * kvd) + 4 * tokens * heads
    full_layer += 4 * c * tokens * f
    rotary = 2 * c * SEQ * head
    assert memory["activations"] == layers * c * tokens * h + rotary + full_layer + 3 * c * tokens * f
    assert memory["comm_buffers"] == c * root + 2 * c * layer + c * layer + 4 * layer
    assert memory["total"] == sum(memory[k] for k in ("params", "grads", "optimizer", "comm_buffers", "activations"))
    assert row["fits"] == (memory["total"] <= int(141e9))


def test_70b_traffic_follows_the_byte_table(plan_70b):
    """HFSDP 1024x8 sends, per step of M=2 microbatches, α(8)Ψ·M(2b_p + b_g) on dp_shard (fp32 reduction, the
    root resharded after forward gathers twice) and α(1024)(Ψ/8)(b_g + b_p) on dp_outer, between nodes."""
    *_, layer, root = _hand_70b()
    psi, m = 80 * layer + root, 2
    row = _by_name(plan_70b, "HFSDP 1024x8")
    assert row["bytes_per_step"]["dp_shard"] == pytest.approx(7 / 8 * psi * m * (2 * 2 + 4), rel=1e-12)
    assert row["bytes_per_step"]["dp_outer"] == pytest.approx(1023 / 1024 * psi / 8 * (4 + 2), rel=1e-12)
    assert row["links"] == {"dp_shard": "intra-node", "dp_outer": "inter-node"}


def test_recommendation_is_the_fastest_layout_that_fits(plan_70b):
    fitting = [r for r in plan_70b["layouts"] if r["fits"]]
    assert fitting, "some layout of a 70B model fits 8,192 H200s with recompute"
    fastest = min(fitting, key=lambda r: r["time_s"]["step"])
    assert plan_70b["recommended"] == fastest["layout"]
    assert plan_70b["why"].startswith(fastest["layout"])
    assert all(not r["fits"] for r in plan_70b["layouts"] if r["memory_bytes"]["total"] > int(141e9))


def test_text_table_marks_what_does_not_fit(llama_70b):
    result = CliRunner().invoke(app, ["plan", "--model-config", str(llama_70b), *PLAN_70B])
    assert result.exit_code == 0, result.output
    assert "Recommended: " in result.output
    assert " NO " in result.output  # DDP of 70B does not fit
    assert "unvalidated" in result.output or "not yet checked" in result.output


def test_plan_is_fast_and_imports_no_torch(llama_70b):
    """1,024 x 8 GPUs and a 70B model: under 2 s of CPU for the whole command, and neither torch nor transformers
    imported."""
    code = (
        "import sys; from hfsdp.cli.main import app\n"
        f"try: app(['plan', '--model-config', {str(llama_70b)!r}, *{PLAN_70B!r}])\n"
        "except SystemExit as e: assert e.code == 0, e.code\n"
        "bad = [m for m in ('torch', 'transformers', 'megatron') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu < 2.0, f"hfsdp plan took {cpu:.2f} s of CPU"


@pytest.mark.parametrize(("args", "code", "needle"), [
    (["--nodes", "0"], 1, "--nodes must be a positive whole number"),
    (["--hidden", "30", "--heads", "4"], 1, "--hidden 30 is not divisible"),
    (["--model-config", "/nonexistent/config.json"], 2, "--model-config: The model config /nonexistent/config.json"),
    (["--mfu", "1.5"], 1, "--mfu is a fraction"),
    (["--format", "yaml"], 1, "--format must be text or json"),
    (["--instances", "3"], 1, "instances 3 does not divide"),
])  # fmt: skip
def test_bad_inputs_are_one_paragraph(args, code, needle):
    result = CliRunner().invoke(app, ["plan", *args])
    assert result.exit_code == code, result.output
    assert needle in result.output
    assert "Traceback" not in result.output


def test_unknown_model_family_is_refused(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt2", "n_embd": 64}))
    result = CliRunner().invoke(app, ["plan", "--model-config", str(path)])
    assert result.exit_code == 1
    assert "llama, mistral, qwen2, mixtral" in result.output


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plan.png"
    result = CliRunner().invoke(app, ["plan", "--plot", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_refused_before_any_work(monkeypatch, tmp_path):
    import hfsdp.cli.commands.plan as plan_module

    monkeypatch.setattr(plan_module.importlib.util, "find_spec", lambda name: None)
    result = CliRunner().invoke(app, ["plan", "--plot", str(tmp_path / "p.png"), "--nodes", "0"])
    assert result.exit_code == 2  # refused before the settings are even checked
    assert "needs matplotlib" in result.output
    assert not (tmp_path / "p.png").exists()
