"""`hfsdp plan --fp8-format ... --fp8-param-gather`: the fp8 weights' share of each unit, and b_p = 1 for them.

The planner's count of the weights fp8 converts (`hf_shape`'s `fp8`, `fp8_weights`, by the run's `--fp8-min-size`)
is checked against `convert_to_float8` with the same min size on the Hugging Face models built on the meta device,
and at the default min size on Llama-3-8B's shape (q/o and the MLP, not k/v); the 70B Llama's plan on 1,024 x 8 GPUs
(no padding: every figure exact) against docs/formulas.md's terms computed here by hand. The bytes a real run
sends are checked record for record in test_plan_traffic_fp8.py.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from hfsdp.cli.main import app
from hfsdp.planning.hf_shape import hf_shape
from hfsdp.planning.model_shape import FP8_MIN_SIZE, fp8_size

from tests.cli.commands.test_plan import LLAMA_70B, NODES, _hand_70b
from tests.planning.test_plan_models import HF_CASES, SMALL

GPUS = 8
BASE = ["--nodes", str(NODES), "--seq-len", "4096", "--micro-batch-size", "1", "--dtype", "bf16", "--recompute"]
FP8 = ["--fp8-format", "hybrid"]
GATHER = [*FP8, "--fp8-param-gather"]
#: More shapes: k and v of 8 outputs (one kv head of 8) stay in bf16, and an MLP of 40 (not a multiple of 16).
FP8_CASES = {
    **HF_CASES,
    "llama-narrow-kv": {"model_type": "llama", "num_key_value_heads": 1, "head_dim": 8},
    "qwen2-odd-ffn": {"model_type": "qwen2", "num_key_value_heads": 2, "intermediate_size": 40},
}


def _converted(config: dict, min_size: float) -> list[tuple[int, int]]:
    """(elements, weights) of each unit's Float8Linear layers after `convert_to_float8(min_size=...)` on the model
    built on the meta device; the root (embeddings, final norm, output layer) last, with none."""
    from hfsdp.core.fp8.config import Float8Config
    from hfsdp.core.fp8.convert import convert_to_float8
    from hfsdp.core.fp8.linear import Float8Linear
    from hfsdp.models import hf

    model = hf.build_causal_lm(hf.config_from_dict(config), device="meta")
    layers = hf.decoder_layers(model)
    convert_to_float8(model, Float8Config(), units=layers, min_size=min_size)
    real = []
    for layer in layers:
        weights = [m.weight for m in layer.modules() if isinstance(m, Float8Linear)]
        real.append((sum(w.numel() for w in weights), len(weights)))
    return [*real, (0, 0)]


#: Min sizes that convert every layer whose dims fit, some (SMALL: q/o of 64 x 64 are 32, the MLP's 64 x 96 38.4,
#: two kv heads' 64 -> 32 21.3), and none of these small models' (the default).
MIN_SIZES = (0, 30, FP8_MIN_SIZE)


@pytest.mark.parametrize("min_size", MIN_SIZES)
@pytest.mark.parametrize("case", list(FP8_CASES))
def test_fp8_weights_per_unit_match_convert_to_float8_on_meta(case, min_size):
    config = {**SMALL, **FP8_CASES[case]}
    real = _converted(config, min_size)
    shape = hf_shape(config, fp8_min_size=min_size)
    assert [(u.fp8, u.fp8_weights) for u in shape.units] == real
    assert all(fp8 <= unit.dense for (fp8, _), unit in zip(real, shape.units, strict=True))
    if min_size == FP8_MIN_SIZE:
        assert hf_shape(config) == shape and not any(u.fp8 for u in shape.units)


def test_the_planners_size_rule_is_convert_pys():
    """planning repeats convert.py's rule (it imports no torch): the same default and the same float for any dims."""
    from torch import nn

    from hfsdp.core.fp8.convert import DEFAULT_MIN_SIZE, size_of

    assert FP8_MIN_SIZE == DEFAULT_MIN_SIZE
    for out_features, in_features in [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (8192, 3072), (48, 32)]:
        linear = nn.Linear(in_features, out_features, device="meta")
        assert fp8_size(out_features, in_features) == size_of(linear)


#: Llama-3-8B's layer shape (8 kv heads of 128: k/v project 4096 -> 1024); two layers are enough to count.
LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 2,
             "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
             "max_position_embeddings": 8192}  # fmt: skip


def test_the_default_rule_at_llama3_8b_converts_q_o_and_the_mlp_not_k_v():
    """q and o (4096 x 4096: in*out/(in+out) = 2048, just taken), gate, up and down (4096 x 14336: 3186) multiply
    in fp8; k and v (4096 -> 1024: 819) stay in bf16. With --fp8-min-size 0 all seven do."""
    h, f, kv = 4096, 14336, 1024
    assert (fp8_size(h, h), fp8_size(kv, h), round(fp8_size(f, h))) == (2048, pytest.approx(819.2), 3186)
    shape = hf_shape(LLAMA3_8B)
    layer = shape.units[0]
    assert (layer.fp8, layer.fp8_weights) == (2 * h * h + 3 * h * f, 5)
    assert [(u.fp8, u.fp8_weights) for u in shape.units] == _converted(LLAMA3_8B, FP8_MIN_SIZE)
    every = hf_shape(LLAMA3_8B, fp8_min_size=0).units[0]
    assert (every.fp8, every.fp8_weights) == (2 * h * h + 2 * kv * h + 3 * h * f, 7)


@pytest.fixture(scope="module")
def llama_70b(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama70b") / "config.json"
    path.write_text(json.dumps(LLAMA_70B))
    return path


def _plan(llama_70b, *flags: str) -> dict:
    result = CliRunner().invoke(app, ["plan", "--model-config", str(llama_70b), *BASE, *flags, "--format", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def _row(plan: dict, name: str) -> dict:
    (row,) = [r for r in plan["layouts"] if r["layout"] == name]
    return row


def _fp8_70b(min_size: float = FP8_MIN_SIZE) -> tuple[int, int]:
    """A 70B layer's fp8 weights by hand: q, o and gate, up, down (5 weights), and with min size 0 k and v too (7);
    k and v project 8192 -> 1024, in*out/(in+out) = 910, below the default 2048."""
    h, f, _layers, heads, kv, _vocab, head, _layer, _root = _hand_70b()
    if min_size == 0:
        return 2 * h * heads * head + 2 * h * kv * head + 3 * h * f, 7
    assert fp8_size(kv * head, h) < min_size <= fp8_size(heads * head, h)
    return 2 * h * heads * head + 3 * h * f, 5


def test_70b_hfsdp_gathers_the_fp8_weights_at_one_byte(llama_70b):
    """HFSDP 1024x8, M = 2: dp_shard carries α(8)·M·(2·(Ψ_8·1 + Ψ_c·2) + Ψ·4) (every unit gathered in forward and
    backward, the root too: a Hugging Face root frees its parameters after forward) plus 2·α(8)·4 bytes per fp8
    weight for the amaxes; dp_outer carries α(1024)(Ψ/8)·b_g for the gradient and the post-step gather of the new
    weights with b_p = 1 for the fp8 weights (each rank's optimizer piece quantized right after the step) and 2 for
    the rest, plus 2·α(1024)·4 per fp8 weight for the amaxes, which are max-reduced over both axes there. Without
    --fp8-param-gather, fp8 matmuls change no byte."""
    *_, layer, root = _hand_70b()
    fp8, weights = _fp8_70b()
    psi, psi_8, m = 80 * layer + root, 80 * fp8, 2
    alpha = 7 / 8
    plain, converted, gathered = (_row(_plan(llama_70b, *f), "HFSDP 1024x8") for f in ([], FP8, GATHER))
    assert converted["bytes_per_step"] == plain["bytes_per_step"]
    inner = alpha * m * (2 * (psi_8 * 1 + (psi - psi_8) * 2) + psi * 4) + 2 * alpha * 4 * weights * 80
    assert gathered["bytes_per_step"]["dp_shard"] == pytest.approx(inner, rel=1e-12)
    alpha_outer = 1023 / 1024
    outer = alpha_outer * (psi * 4 + psi_8 * 1 + (psi - psi_8) * 2) / GPUS + 2 * alpha_outer * 4 * weights * 80
    assert gathered["bytes_per_step"]["dp_outer"] == pytest.approx(outer, rel=1e-12)
    assert plain["bytes_per_step"]["dp_outer"] - outer == pytest.approx(
        alpha_outer * psi_8 / GPUS - 2 * alpha_outer * 4 * weights * 80
    )
    assert plain["bytes_per_step"]["dp_shard"] - inner == pytest.approx(
        alpha * m * 2 * psi_8 - 2 * alpha * 4 * weights * 80
    )


def test_70b_with_min_size_0_gathers_k_and_v_in_fp8_too(llama_70b):
    """--fp8-min-size 0: the seven weights of each layer are the fp8 group; the same terms with their Ψ_8."""
    *_, layer, root = _hand_70b()
    fp8, weights = _fp8_70b(0)
    psi, psi_8, m = 80 * layer + root, 80 * fp8, 2
    alpha = 7 / 8
    row = _row(_plan(llama_70b, *GATHER, "--fp8-min-size", "0"), "HFSDP 1024x8")
    inner = alpha * m * (2 * (psi_8 * 1 + (psi - psi_8) * 2) + psi * 4) + 2 * alpha * 4 * weights * 80
    assert row["bytes_per_step"]["dp_shard"] == pytest.approx(inner, rel=1e-12)
    assert fp8 > _fp8_70b()[0]


def test_70b_zero3_over_zero3_gathers_and_reduces_amaxes_on_both_axes(llama_70b):
    """Where the outer axis shards parameters too, its gathers move fp8 bytes and it max-reduces the amaxes too:
    dp_outer carries α(1024)·M·(2·(Ψ_8/8·1 + Ψ_c/8·2)) for the gathers (each of the inner shard) beside the
    reduce-scatter of the gradient, α(1024)·(Ψ/8)·4 on the last microbatch, and 2·α(1024)·4 per fp8 weight."""
    *_, layer, root = _hand_70b()
    fp8, weights = _fp8_70b()
    psi, psi_8, m = 80 * layer + root, 80 * fp8, 2
    alpha = 1023 / 1024
    row = _row(_plan(llama_70b, *GATHER), "ZeRO-3 over ZeRO-3 1024x8")
    gathers = alpha * m * 2 * (psi_8 * 1 + (psi - psi_8) * 2) / GPUS
    outer = gathers + alpha * psi / GPUS * 4 + 2 * alpha * 4 * weights * 80
    assert row["bytes_per_step"]["dp_outer"] == pytest.approx(outer, rel=1e-12)


def test_70b_memory_keeps_the_fp8_piece_and_gathers_one_byte(llama_70b):
    """HSDP 1024x8 keeps no bf16 shard but the quantized piece of the fp8 weights, Ψ_8/8 bytes; the last layer's
    backward holds the two layers it gathered at Ψ_8·1 + Ψ_c·2 bytes each instead of 2 per element."""
    fp8, _ = _fp8_70b()
    plain, gathered = (_row(_plan(llama_70b, *f), "HSDP 1024x8")["memory_bytes"] for f in ([], GATHER))
    assert plain["params"] == 0
    assert gathered["params"] == 80 * fp8 // GPUS
    assert gathered["peak_at"] == plain["peak_at"] == "backward"
    assert plain["comm_buffers"] - gathered["comm_buffers"] == 2 * fp8 * (2 - 1)


def test_the_plan_says_what_fp8_it_planned(llama_70b):
    plan = _plan(llama_70b, *GATHER)
    assert {k: plan["step"][k] for k in ("fp8", "fp8_recipe", "fp8_min_size", "fp8_param_gather")} == {
        "fp8": "hybrid",
        "fp8_recipe": "tensorwise",
        "fp8_min_size": 2048,
        "fp8_param_gather": True,
    }
    assert _plan(llama_70b)["step"]["fp8"] is None and _plan(llama_70b)["step"]["fp8_min_size"] is None
    text = CliRunner().invoke(app, ["plan", "--model-config", str(llama_70b), *BASE, *GATHER])
    assert text.exit_code == 0, text.output
    said = "bf16, fp8 hybrid tensorwise on 5 Linear layers per transformer layer (in*out/(in+out) >= 2048), weights "
    assert said + "gathered in fp8," in text.output
    text = CliRunner().invoke(app, ["plan", "--model-config", str(llama_70b), *BASE, *FP8, "--fp8-min-size", "0"])
    assert text.exit_code == 0, text.output
    assert "fp8 hybrid tensorwise on 7 Linear layers per transformer layer (in*out/(in+out) >= 0), weights " in (
        text.output
    )


def test_a_model_too_small_for_the_min_size_plans_no_fp8_gather(tmp_path):
    """What train does: nothing converted, so no fp8 gather is asked of fully_shard; the plan's bytes are bf16's and
    it says why."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**SMALL, **HF_CASES["llama"]}))
    base = ["plan", "--model-config", str(path), "--nodes", "1", "--gpus-per-node", "4", "--dtype", "bf16"]
    runs = {}
    for name, flags in {"plain": [], "gather": GATHER, "forced": [*GATHER, "--fp8-min-size", "0"]}.items():
        result = CliRunner().invoke(app, [*base, *flags, "--format", "json"])
        assert result.exit_code == 0, result.output
        runs[name] = json.loads(result.output)
    assert runs["gather"]["step"]["fp8_param_gather"] is False and runs["forced"]["step"]["fp8_param_gather"]
    by_layout = {name: {r["layout"]: r["bytes_per_step"] for r in run["layouts"]} for name, run in runs.items()}
    assert by_layout["gather"] == by_layout["plain"] != by_layout["forced"]
    text = CliRunner().invoke(app, [*base, *GATHER])
    assert "bf16, fp8 hybrid tensorwise on no Linear layer (none has dims multiples of 16 and in*out/(in+out) >= " in (
        text.output
    )
    assert "2048), so all bf16, recompute" in text.output


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--fp8-param-gather"], "--fp8-param-gather true gathers fp8 weights, but fp8 is off"),
        ([*GATHER, "--fp8-recipe", "rowwise"], "--fp8-param-gather"),
        (["--fp8-format", "e5m2"], "--fp8-format"),
        (
            ["--fp8-min-size", "0"],
            "--fp8-min-size 0.0 chooses which Linear layers are large enough for fp8, but fp8 is",
        ),
        ([*FP8, "--fp8-min-size", "-2048"], "--fp8-min-size must be a number >= 0 such as 0 or 2048"),
    ],
)
def test_plan_refuses_the_fp8_flags_train_refuses(llama_70b, flags, needle):
    result = CliRunner().invoke(app, ["plan", "--model-config", str(llama_70b), *BASE, *flags])
    assert result.exit_code == 1, result.output
    assert needle in result.output


def test_plan_refuses_fp8_for_the_megatron_gpt():
    result = CliRunner().invoke(app, ["plan", "--dtype", "bf16", *GATHER])
    assert result.exit_code == 1, result.output
    assert "converts the nn.Linear layers of a Hugging Face model" in result.output
