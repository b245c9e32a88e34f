"""FP8 training's settings (issue 39): Megatron's flags and keys, the rules before launch (exit 1, one paragraph
naming the flag or key and the fix), the GPU check (fp8 tensor cores from compute capability 8.9), and what an
accepted value asks of the model's build."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from hfsdp.cli.main import app
from hfsdp.cli.settings.settings import BY_NAME, FP8_FORMATS, FP8_MIN_SIZE, FP8_RECIPES
from hfsdp.cli.settings.train_config import build_file_config, build_train_config

from tests.support.runs import LLAMA
from tests.support.settings import train_problems

runner = CliRunner()
FP8 = {"fp8": "hybrid", "dtype": "bf16"}


@pytest.fixture
def llama(tmp_path) -> str:
    path = tmp_path / "llama.json"
    path.write_text(json.dumps(LLAMA))
    return str(path)


def _validate(tmp_path, sections: dict):
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps({"parallel": {"world_size": 2}, **sections}))
    result = runner.invoke(app, ["validate-config", str(path), "--format", "json"])
    return result, {e["field"]: e["message"] for e in json.loads(result.output)["errors"]}


def test_the_settings_are_megatrons_flags_and_keys_off_by_default():
    names = ("fp8", "fp8_recipe", "fp8_min_size", "fp8_param_gather")
    spelled = {name: (BY_NAME[name].flag, BY_NAME[name].key) for name in names}
    assert spelled == {
        "fp8": ("--fp8-format", "model.fp8"),
        "fp8_recipe": ("--fp8-recipe", "model.fp8_recipe"),
        "fp8_min_size": ("--fp8-min-size", "model.fp8_min_size"),
        "fp8_param_gather": ("--fp8-param-gather", "ddp.fp8_param_gather"),
    }
    cfg = build_train_config({"device": "cpu"})
    assert (cfg.fp8, cfg.fp8_recipe, cfg.fp8_min_size, cfg.fp8_param_gather) == (None, "tensorwise", 2048, False)


def test_the_cli_names_are_cores():
    """settings.py keeps the choices as text (no import of core's fp8 package); they are core's Float8Config's."""
    from hfsdp.core.fp8.config import FORMATS, RECIPES
    from hfsdp.core.fp8.convert import DEFAULT_MIN_SIZE

    assert FP8_FORMATS == FORMATS and FP8_RECIPES == RECIPES and FP8_MIN_SIZE == DEFAULT_MIN_SIZE


def test_a_hugging_face_run_in_bf16_accepts_every_valid_combination(llama):
    for fmt, recipe, gather in [("hybrid", None, True), ("e4m3", "tensorwise", False), ("e4m3", "rowwise", False)]:
        flags = {"device": "cpu", "model_config": llama, "dtype": "bf16", "fp8": fmt, "fp8_recipe": recipe}
        cfg = build_train_config({**flags, "fp8_param_gather": gather})
        assert (cfg.fp8, cfg.fp8_recipe, cfg.fp8_param_gather) == (fmt, recipe or "tensorwise", gather)


def test_an_unknown_format_or_recipe_is_refused_with_what_each_means(llama):
    problems = train_problems({**FP8, "model_config": llama, "fp8": "e5m2", "fp8_recipe": "delayed"})
    assert problems["--fp8-format"] == (
        "--fp8-format must be one of e4m3, hybrid (e4m3 for every tensor, or hybrid: e4m3 forward, e5m2 gradients; "
        "unset: no fp8); got 'e5m2'."
    )
    assert problems["--fp8-recipe"].startswith("--fp8-recipe must be one of tensorwise, rowwise (one scale per ")
    assert "hfsdp has no delayed, blockwise or mxfp8" in problems["--fp8-recipe"]
    typo = train_problems({**FP8, "model_config": llama, "fp8": "hybird"})
    assert typo == {"--fp8-format": "--fp8-format must be one of e4m3, hybrid (did you mean hybrid?); got 'hybird'."}


@pytest.mark.parametrize("name", ["fp8_recipe", "fp8_min_size", "fp8_param_gather"])
def test_a_recipe_a_min_size_or_the_fp8_gather_without_a_format_is_refused(name, llama):
    flag = BY_NAME[name].flag
    value = {"fp8_param_gather": True, "fp8_min_size": 0.0}.get(name, "rowwise")
    (message,) = train_problems({"model_config": llama, "dtype": "bf16", name: value}).values()
    assert message.startswith(f"{flag} ") and "but fp8 is off (--fp8-format is not set)" in message
    assert message.endswith(f"turn it on with --fp8-format hybrid (or e4m3), or drop {flag}.")
    # A recipe given at all would be ignored, the default's too; the gather switched off by hand says nothing.
    assert list(train_problems({"fp8_recipe": "tensorwise"})) == ["--fp8-recipe"]
    assert list(train_problems({"fp8_min_size": float(FP8_MIN_SIZE)})) == ["--fp8-min-size"]
    build_train_config({"device": "cpu", "fp8_param_gather": False})


def test_a_min_size_of_zero_or_more_is_taken(llama):
    for size in (0.0, 819.2, 2048, 4096.0):
        cfg = build_train_config({**FP8, "device": "cpu", "model_config": llama, "fp8_min_size": size})
        assert cfg.fp8_min_size == size


@pytest.mark.parametrize("value", [-1.0, -0.5, float("nan"), float("inf"), "big", "2048", True])
def test_a_negative_or_non_numeric_min_size_is_refused_in_one_paragraph(value, llama):
    """What a file could hold (a flag is a float by then: typer refuses text, test below)."""
    problems = train_problems({**FP8, "model_config": llama, "fp8_min_size": value})
    assert list(problems) == ["--fp8-min-size"], problems
    (message,) = problems.values()
    assert message.startswith("--fp8-min-size must be a number >= 0 such as 0 or 2048: a Linear layer multiplies in ")
    assert "in*out/(in+out) is at least this (0: every layer whose dims are multiples of 16); got " in message
    assert "\n" not in message and message.endswith(".")


def test_train_refuses_a_min_size_that_is_no_number_naming_the_flag(llama):
    base = ["train", "--fp8-format", "hybrid", "--dtype", "bf16", "--model-config", llama, "--device", "cpu"]
    result = runner.invoke(app, [*base, "--fp8-min-size", "big"])
    assert result.exit_code == 2 and "Invalid value for '--fp8-min-size'" in result.output, result.output
    result = runner.invoke(app, [*base, "--fp8-min-size", "-1"])
    assert result.exit_code == 1
    assert result.output.startswith("error: --fp8-min-size must be a number >= 0 such as 0 or 2048"), result.output
    assert result.output.rstrip().endswith("got -1.0.") and "starting" not in result.output


def test_the_fp8_gather_needs_the_tensorwise_recipe(llama):
    (message,) = train_problems(
        {**FP8, "model_config": llama, "fp8": "e4m3", "fp8_recipe": "rowwise", "fp8_param_gather": True}
    ).values()
    assert message.startswith("--fp8-param-gather true gathers each weight already quantized on its shard")
    assert "but --fp8-recipe 'rowwise' takes one per row" in message
    assert message.endswith("use --fp8-recipe tensorwise, or drop --fp8-param-gather.")


def test_rowwise_has_no_hybrid_form(llama):
    (message,) = train_problems({**FP8, "model_config": llama, "fp8_recipe": "rowwise"}).values()
    assert message.startswith("--fp8-format 'hybrid' keeps gradients in e5m2, but --fp8-recipe 'rowwise'")
    assert "as torchao's rowwise recipe does" in message
    assert message.endswith("use --fp8-format e4m3 with rowwise, or --fp8-recipe tensorwise with hybrid.")


def test_fp8_needs_bf16_compute(llama):
    (message,) = train_problems({"fp8": "e4m3", "model_config": llama}).values()
    assert message.startswith("--fp8-format 'e4m3' needs bf16 compute, but --dtype 'fp32' (the default)")
    assert message.endswith("add --dtype bf16, or drop --fp8-format.")


def test_fp8_is_refused_on_the_megatron_gpt():
    (message,) = train_problems(FP8).values()
    assert message.startswith("--fp8-format 'hybrid' converts the nn.Linear layers of a Hugging Face model, but")
    assert "megatron's own parallel linears, which need TransformerEngine for fp8" in message
    assert message.endswith("(--model-config PATH/config.json), or drop --fp8-format.")


def test_config_file_keys_are_refused_by_key_with_exit_1(tmp_path, llama):
    cases = [
        ({"model": {"fp8_recipe": "rowwise"}}, "model.fp8_recipe", "turn it on with model.fp8: hybrid (or e4m3)"),
        ({"ddp": {"fp8_param_gather": True}}, "ddp.fp8_param_gather", "or drop ddp.fp8_param_gather."),
        ({"model": {"fp8_min_size": 0}}, "model.fp8_min_size", "turn it on with model.fp8: hybrid (or e4m3)"),
        (
            {"model": {"fp8": "e4m3", "fp8_min_size": -16, "hf_config": llama}, "train": {"dtype": "bf16"}},
            "model.fp8_min_size",
            "model.fp8_min_size must be a number >= 0 such as 0 or 2048",
        ),
        (
            {"model": {"fp8": "e4m3", "fp8_min_size": "large", "hf_config": llama}, "train": {"dtype": "bf16"}},
            "model.fp8_min_size",
            "got 'large'.",
        ),
        ({"model": {"fp8": "e5m2"}}, "model.fp8", "model.fp8 must be one of e4m3, hybrid"),
        (
            {
                "model": {"fp8": "e4m3", "fp8_recipe": "rowwise", "hf_config": llama},
                "ddp": {"fp8_param_gather": True},
                "train": {"dtype": "bf16"},
            },
            "ddp.fp8_param_gather",
            "use model.fp8_recipe: tensorwise, or drop ddp.fp8_param_gather.",
        ),
        (
            {"model": {"fp8": "hybrid", "fp8_recipe": "rowwise", "hf_config": llama}, "train": {"dtype": "bf16"}},
            "model.fp8",
            "use model.fp8: e4m3 with rowwise, or model.fp8_recipe: tensorwise with hybrid.",
        ),
        ({"model": {"fp8": "hybrid", "hf_config": llama}}, "model.fp8", "add train.dtype: bf16, or drop model.fp8."),
        (
            {"model": {"fp8": "hybrid"}, "train": {"dtype": "bf16"}},
            "model.fp8",
            "train a Hugging Face model instead (model.hf_config: PATH/config.json), or drop model.fp8.",
        ),
    ]
    for sections, key, needle in cases:
        result, errors = _validate(tmp_path, sections)
        assert result.exit_code == 1, result.output
        assert list(errors) == [key] and needle in errors[key], (sections, errors)


def test_a_valid_file_lists_the_settings_and_train_reads_the_same(tmp_path, llama):
    sections = {"model": {"fp8": "e4m3", "fp8_recipe": "tensorwise", "fp8_min_size": 0, "hf_config": llama},
                "ddp": {"fp8_param_gather": True}, "train": {"dtype": "bf16"}}  # fmt: skip
    result, errors = _validate(tmp_path, sections)
    assert result.exit_code == 0 and not errors, result.output
    settings = json.loads(result.output)["summary"]["settings"]
    assert settings["model.fp8"] == {"value": "e4m3", "default": False}
    assert settings["model.fp8_min_size"] == {"value": 0, "default": False}
    assert settings["ddp.fp8_param_gather"] == {"value": True, "default": False}
    cfg = build_file_config(str(tmp_path / "run.yaml"))
    assert (cfg.fp8, cfg.fp8_recipe, cfg.fp8_min_size, cfg.fp8_param_gather) == ("e4m3", "tensorwise", 0, True)
    # `model: fp8: null` is fp8 off, as leaving it out.
    result, _ = _validate(tmp_path, {"model": {"fp8": None}})
    assert result.exit_code == 0, result.output


def test_train_refuses_before_any_rank_starts_with_exit_1(llama):
    result = runner.invoke(app, ["train", "--fp8-format", "hybrid", "--fp8-recipe", "rowwise", "--dtype", "bf16",
                                 "--model-config", llama, "--device", "cpu", "--nproc", "2"])  # fmt: skip
    assert result.exit_code == 1
    assert result.output.startswith("error: --fp8-format 'hybrid' keeps gradients in e5m2")
    assert "Traceback" not in result.output and "starting" not in result.output


# The GPU: fp8 tensor cores from compute capability 8.9 ------------------------------------------------------------


def test_the_capability_decision():
    from hfsdp.cli.checks.fp8_device import fp8_refusal

    for capability in [(8, 9), (9, 0), (10, 0), (12, 0)]:
        assert fp8_refusal(capability, "NVIDIA H200", "--fp8-format 'hybrid'") is None
    for capability in [(8, 0), (8, 6), (7, 5)]:
        message = fp8_refusal(capability, "NVIDIA A100-SXM4-80GB", "--fp8-format 'hybrid'")
        assert message.startswith("--fp8-format 'hybrid' needs fp8 tensor cores, which GPUs have from compute ")
        assert f"this machine's NVIDIA A100-SXM4-80GB has {capability[0]}.{capability[1]}" in message
        assert "drop --fp8-format" in message
    assert "drop model.fp8" in fp8_refusal((8, 0), "A100", "model.fp8 'e4m3'", "model.fp8")


def _gpus(monkeypatch, capabilities: list[tuple[int, int]]) -> None:
    """Pretend this machine has GPUs of these capabilities (the pre-launch checks only ask torch about them)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(capabilities))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: capabilities[i])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: f"GPU{i} sm{''.join(map(str, capabilities[i]))}")


def test_train_refuses_fp8_on_a_gpu_without_fp8_before_launch(monkeypatch, llama):
    """The check runs with the other device checks (preflight: exit 2, as a device that cannot be used), names the
    GPU, and looks at every GPU this machine's ranks use; a GPU run without fp8 is not asked about capability."""
    from hfsdp.cli.checks.preflight import PreflightError, preflight

    flags = {**FP8, "model_config": llama, "device": "cuda", "nproc": 2}
    _gpus(monkeypatch, [(9, 0), (8, 0)])
    with pytest.raises(PreflightError) as err:
        preflight(build_train_config(flags))
    ((field, message),) = [(p.field, p.message) for p in err.value.problems]
    assert field == "--fp8-format" and "this machine's GPU1 sm80 has 8.0" in message
    preflight(build_train_config({**flags, "fp8": None}))  # bf16 on the same GPUs: fine
    preflight(build_train_config({**flags, "nproc": 1}))  # the rank on GPU 0 (9.0) alone: fine

    result = runner.invoke(app, ["train", "--fp8-format", "hybrid", "--dtype", "bf16", "--model-config", llama,
                                 "--device", "cuda", "--nproc", "2"])  # fmt: skip
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: --fp8-format 'hybrid' needs fp8 tensor cores")
    assert "Traceback" not in result.output and "starting" not in result.output


def test_a_cpu_run_takes_fp8_whatever_the_gpus(monkeypatch, llama):
    from hfsdp.cli.checks.preflight import preflight

    _gpus(monkeypatch, [(8, 0)])
    preflight(build_train_config({**FP8, "model_config": llama, "device": "cpu", "nproc": 2}))


# What the build asks of core -------------------------------------------------------------------------------------


def _converted(cfg):
    """The tiny Llama (tests.support.runs.LLAMA: hidden 32, MLP 48, two kv heads of 8) on the meta device, converted
    as `hfsdp train` converts it with `cfg`."""
    from hfsdp.cli.rank.build_model import convert_fp8
    from hfsdp.models import hf

    model = hf.build_causal_lm(hf.config_from_dict(LLAMA), device="meta")
    return convert_fp8(cfg, model, hf.decoder_layers(model))


def test_fully_shard_is_asked_for_the_fp8_gather_only_when_fp8_is_on_and_converted_a_layer(llama):
    from hfsdp.cli.rank.build_model import convert_fp8, fp8_shard_options

    off = build_train_config({"device": "cpu", "model_config": llama})
    assert fp8_shard_options(off, None) == {} and convert_fp8(off, None, []) is None
    on = build_train_config({**FP8, "device": "cpu", "model_config": llama, "fp8_param_gather": True})
    forced = build_train_config({**FP8, "device": "cpu", "model_config": llama, "fp8_param_gather": True,
                                 "fp8_min_size": 0.0})  # fmt: skip
    assert fp8_shard_options(forced, _converted(forced)) == {"fp8_param_gather": True}
    # The default min size converts none of the tiny model's layers: no fp8 gather, which fully_shard would refuse.
    assert not _converted(on).converted
    assert fp8_shard_options(on, _converted(on)) == {"fp8_param_gather": False}
    on = build_train_config({**FP8, "device": "cpu", "model_config": llama})
    assert fp8_shard_options(on, _converted(on)) == {"fp8_param_gather": False}


def test_the_start_line_says_why_fp8_is_off_when_nothing_was_converted(llama, tmp_path):
    from hfsdp.cli.rank.build_model import convert_fp8, fp8_start_line
    from hfsdp.models import hf

    forced = build_train_config({**FP8, "device": "cpu", "model_config": llama, "fp8_min_size": 0.0})
    line = fp8_start_line(forced, _converted(forced))
    assert line.startswith("fp8 (hybrid, tensorwise): 14 of 14 Linear layers") and "fp8 is off" not in line
    on = build_train_config({**FP8, "device": "cpu", "model_config": llama})
    conversion = _converted(on)
    line = fp8_start_line(on, conversion)
    assert line.startswith(conversion.summary() + ". ")
    assert line.startswith("fp8 (hybrid, tensorwise): 0 of 14 Linear layers in the units multiply in fp8; 14 stay ")
    assert line.endswith(
        ". fp8 is off for this model: no layer is large enough to gain from it, so it trains in bf16; "
        "--fp8-min-size 0 forces fp8."
    )
    # From a config file, the key is named as the file spells it.
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps({"model": {"fp8": "hybrid", "hf_config": llama}, "train": {"dtype": "bf16"},
                                "parallel": {"world_size": 2}}))  # fmt: skip
    filed = build_file_config(str(path))
    assert fp8_start_line(filed, _converted(filed)).endswith("; model.fp8_min_size: 0 forces fp8.")
    # Layers that no min size makes fp8 (dims not multiples of 16): fp8 is off, and the min size is not the way out.
    odd = {**LLAMA, "hidden_size": 40, "intermediate_size": 56, "num_attention_heads": 5, "num_key_value_heads": 5}
    model = hf.build_causal_lm(hf.config_from_dict(odd), device="meta")
    conversion = convert_fp8(forced, model, hf.decoder_layers(model))
    assert not conversion.converted
    line = fp8_start_line(forced, conversion)
    assert line.endswith(". fp8 is off for this model: none of its layers can multiply in fp8, so it trains in bf16.")
