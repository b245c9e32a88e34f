"""`hfsdp train`'s configuration: flag > file > default, every invalid setting named by its flag or key, and
exactly the rules `hfsdp validate-config` applies."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from hfsdp.cli.settings.config_file import ConfigFileError
from hfsdp.cli.settings.settings import SETTINGS
from hfsdp.cli.settings.train_config import build_file_config, build_train_config
from hfsdp.core.rules.config import MEGATRON_NAMES, ConfigError

LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4, "max_position_embeddings": 32}  # fmt: skip


def _build(flags=None, world=None, torchrun_world=None):
    flags = dict(flags or {})
    if world is not None:
        flags["nproc"] = world
    return build_train_config(flags, torchrun_world=torchrun_world)


def _fields(err: ConfigError) -> set[str]:
    return {p.field for p in err.problems}


def _write(tmp_path, name: str, data: dict):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def test_defaults_train_zero3_on_four_ranks():
    """With no flags the run is ZeRO-3 over 4 ranks, 16 sequences per step in 2 microbatches, 20 steps."""
    cfg = _build()
    assert cfg.layout.layout_name.startswith("ZeRO-3 1x4")
    assert cfg.nproc == 4 and cfg.num_microbatches == 2 and cfg.layout.global_batch_size == 16 and cfg.steps == 20
    assert not cfg.explicit("lr")


def test_flags_override_the_config_file(tmp_path):
    """A config file sets the layout and model; a flag given on the command line wins over it."""
    path = tmp_path / "run.yaml"
    path.write_text(
        "parallel: {world_size: 8}\n"
        "ddp: {outer_dp_sharding_strategy: optim, num_distributed_optimizer_instances: 2}\n"
        "model: {hidden_size: 48, num_attention_heads: 4}\n"
        "train: {global_batch_size: 16, micro_batch_size: 1, train_iters: 7, lr: 1e-4}\n"
    )
    cfg = _build({"config": str(path), "steps": 3})
    assert cfg.layout.layout_name.startswith("HFSDP 2x4")
    assert (cfg.hidden, cfg.steps, cfg.lr, cfg.layout.global_batch_size) == (48, 3, 1e-4, 16)
    assert cfg.given["steps"].spelled == "--steps" and cfg.given["lr"].spelled == "train.lr"
    assert cfg.explicit("lr") and cfg.explicit("steps") and not cfg.explicit("seed")


def test_the_files_world_size_sets_nproc(tmp_path):
    """Without --nproc, a file's world size is the number of local ranks (not the --nproc default of 4)."""
    path = _write(tmp_path, "w8.json", {"parallel": {"world_size": 8}})
    cfg = _build({"config": str(path)})
    assert cfg.nproc == 8 and cfg.layout.world_size == 8


def test_nproc_that_disagrees_with_the_file_is_refused(tmp_path):
    """An explicit --nproc other than the file's world size is an error naming both, not a silent override."""
    path = _write(tmp_path, "w8.json", {"parallel": {"world_size": 8}})
    with pytest.raises(ConfigError) as err:
        _build({"config": str(path)}, world=4)
    assert _fields(err.value) == {"--nproc"}
    assert "parallel.world_size 8" in err.value.problems[0].message
    assert _build({"config": str(path)}, world=8).nproc == 8


def test_torchrun_world_size_must_agree_with_the_file(tmp_path):
    """Under an external torchrun, WORLD_SIZE is the world; a file saying otherwise is refused."""
    path = _write(tmp_path, "w8.json", {"parallel": {"world_size": 8}})
    with pytest.raises(ConfigError) as err:
        _build({"config": str(path)}, torchrun_world=4)
    assert _fields(err.value) == {"parallel.world_size"}
    assert "WORLD_SIZE=4" in err.value.problems[0].message
    assert _build({"config": str(path)}, torchrun_world=8).layout.world_size == 8
    assert _build({}, torchrun_world=2).layout.world_size == 2


def test_a_file_without_world_size_needs_nproc(tmp_path):
    """As validate-config needs --world-size, train needs --nproc (or torchrun) for a file that has no world size."""
    path = _write(tmp_path, "now.json", {"ddp": {"outer_dp_sharding_strategy": "no_shard"}})
    with pytest.raises(ConfigError) as err:
        _build({"config": str(path)})
    assert _fields(err.value) == {"parallel.world_size"} and "--nproc N" in err.value.problems[0].message
    assert _build({"config": str(path)}, world=2).layout.world_size == 2


def test_invalid_settings_are_all_reported_by_flag():
    """Bad values are reported together, each under its flag, before anything starts."""
    with pytest.raises(ConfigError) as err:
        _build({"outer": "optim", "hidden": 30, "heads": 4, "dtype": "fp16", "lr": 0.0, "save_every": 5})
    assert _fields(err.value) == {"--outer", "--hidden", "--dtype", "--lr", "--save-every"}


def test_nproc_zero_blames_nproc():
    """`--nproc 0` is reported under --nproc, the flag the user typed."""
    with pytest.raises(ConfigError) as err:
        _build(world=0)
    assert _fields(err.value) == {"--nproc"}


def test_moe_experts_zero_means_dense():
    """`--moe-experts 0` is a dense model, as --help says, not an error."""
    cfg = _build({"num_moe_experts": 0})
    assert cfg.layout.num_moe_experts is None and cfg.num_moe_experts is None


def test_batch_sizes_must_split_over_ranks():
    """A global batch that does not split into micro_batch_size x dp is rejected under --global-batch-size."""
    with pytest.raises(ConfigError) as err:
        _build({"global_batch_size": 10, "micro_batch_size": 2})
    assert "--global-batch-size" in _fields(err.value)


def test_moe_topk_cannot_exceed_experts_even_by_default():
    """Routing to more experts than exist is rejected under --moe-topk, including the default top-k of 2."""
    with pytest.raises(ConfigError) as err:
        _build({"num_moe_experts": 2, "moe_topk": 3})
    assert _fields(err.value) == {"--moe-topk"}
    with pytest.raises(ConfigError) as err:
        _build({"num_moe_experts": 1})
    assert _fields(err.value) == {"--moe-topk"} and "(the default)" in err.value.problems[0].message


def test_a_misspelt_key_is_one_problem(tmp_path):
    """A misspelt key is reported once; its value still counts as the intended key's, so no second complaint."""
    data = {"parallel": {"world_sise": 8}, "ddp": {"outer_dp_sharding_strategy": "optim"}}
    data["ddp"]["num_distributed_optimizer_instance"] = 2
    path = _write(tmp_path, "typo.json", data)
    for build in (lambda: build_file_config(str(path)), lambda: _build({"config": str(path)})):
        with pytest.raises(ConfigError) as err:
            build()
        assert _fields(err.value) == {"parallel.world_sise", "ddp.num_distributed_optimizer_instance"}


def test_every_layout_file_key_is_a_setting():
    """The settings table knows every key core's MEGATRON_NAMES does, under the same name: one vocabulary."""
    keys = {s.name: s.key for s in SETTINGS if s.layout}
    assert keys == MEGATRON_NAMES


# validate-config and train agree -----------------------------------------------------------------

VALUES = {
    "parallel.world_size": [1, 2, 4, 8, 6],
    "parallel.expert_model_parallel_size": [1, 2],
    "ddp.data_parallel_sharding_strategy": ["optim_grads_params", "optim_grads", "optim"],
    "ddp.outer_dp_sharding_strategy": ["no_shard", "optim", "optim_grads"],
    "ddp.num_distributed_optimizer_instances": [1, 2, 3],
    "model.num_moe_experts": [0, 1, 2, 4],
    "model.moe_router_topk": [1, 2, 4],
    "model.hidden_size": [64, 30, 48],
    "model.num_attention_heads": [4, 3, 8],
    "train.lr": [3e-4, 0, -1.0, "1e-4"],
    "train.dtype": ["fp32", "bf16", "fp16"],
    "train.clip_grad": [1.0, 0.0, -0.5],
    "train.train_iters": [1, 0, 20],
    "train.global_batch_size": [16, 12, 64],
    "train.micro_batch_size": [1, 2, 4],
}


def test_validate_config_and_train_accept_exactly_the_same_files(tmp_path):
    """Four hundred generated configs: `validate-config FILE` and `train --config FILE` give the same verdict
    and the same problems, because both go through one resolve()."""
    rng = random.Random(9)
    verdicts = []
    for i in range(400):
        data: dict = {"parallel": {"world_size": rng.choice(VALUES["parallel.world_size"])}}
        for key in rng.sample(list(VALUES), rng.randint(0, 6)):
            section, name = key.split(".")
            data.setdefault(section, {})[name] = rng.choice(VALUES[key])
        path = _write(tmp_path, f"c{i}.json", data)
        outcomes = []
        for build in (lambda p=path: build_file_config(str(p)), lambda p=path: _build({"config": str(p)})):
            try:
                cfg = build()
                outcomes.append(("ok", cfg.layout, dict(cfg.values)))
            except ConfigError as err:
                outcomes.append(("refused", sorted((p.field, p.message) for p in err.problems)))
        assert outcomes[0] == outcomes[1], (data, outcomes)
        verdicts.append(outcomes[0][0])
    assert 50 < verdicts.count("ok") < 350  # both verdicts are well represented


def test_unreadable_config_file_is_a_config_file_error(tmp_path):
    """train --config on a missing file raises ConfigFileError (exit 2), not a ConfigError."""
    with pytest.raises(ConfigFileError):
        _build({"config": str(tmp_path / "missing.yaml")})


@pytest.mark.parametrize(("flag", "value"), list(itertools.product(["lr", "clip_grad"], [float("nan"), float("inf")])))
def test_non_finite_numbers_are_refused(flag, value):
    """NaN and infinity are not learning rates or clipping norms."""
    with pytest.raises(ConfigError) as err:
        _build({flag: value})
    assert _fields(err.value) == {"--" + flag.replace("_", "-")}


def test_model_config_excludes_the_gpts_model_flags(tmp_path):
    """--model-config builds the model its config.json describes: a GPT shape flag beside it is refused under
    --model-config, naming the flag; the defaults of those flags do not count."""
    config = str(_write(tmp_path, "config.json", LLAMA))
    assert _build({"model_config": config}).model_config == config
    with pytest.raises(ConfigError) as err:
        _build({"model_config": config, "layers": 4})
    assert _fields(err.value) == {"--model-config"} and "--layers 4" in err.value.problems[0].message


def test_learning_rate_schedule_rules():
    """--min-lr above --lr, a warmup that reaches the end of a decay, and query groups that do not divide the
    heads are each refused under their flag; a constant schedule may warm up for the whole run."""
    with pytest.raises(ConfigError) as err:
        _build({"lr": 1e-3, "min_lr": 1e-2})
    assert _fields(err.value) == {"--min-lr"}
    with pytest.raises(ConfigError) as err:
        _build({"lr_decay_style": "cosine", "lr_warmup_iters": 20, "steps": 20})
    assert _fields(err.value) == {"--lr-warmup-iters"} and "--steps" in err.value.problems[0].message
    with pytest.raises(ConfigError) as err:
        _build({"lr_decay_style": "wsd"})
    assert _fields(err.value) == {"--lr-decay-style"}
    with pytest.raises(ConfigError) as err:
        _build({"num_query_groups": 3})
    assert _fields(err.value) == {"--num-query-groups"}
    assert _build({"lr_warmup_iters": 20, "steps": 20}).lr_warmup_iters == 20


def test_schedule_recompute_and_eval_keys_in_a_config_file(tmp_path):
    """The new settings read from Megatron-named keys of a config file, with the same rules as their flags."""
    data = {
        "parallel": {"world_size": 4},
        "train": {
            "lr_warmup_iters": 2,
            "lr_decay_style": "linear",
            "min_lr": 1e-5,
            "recompute": True,
            "eval_interval": 5,
        },
        "model": {"normalization": "RMSNorm", "swiglu": True, "num_query_groups": 2},
    }
    cfg = build_file_config(str(_write(tmp_path, "cfg.json", data)))
    assert (cfg.lr_decay_style, cfg.min_lr, cfg.recompute, cfg.eval_interval) == ("linear", 1e-5, True, 5)
    assert (cfg.normalization, cfg.swiglu, cfg.num_query_groups) == ("RMSNorm", True, 2)
    data["train"]["recompute"] = "yes"
    with pytest.raises(ConfigError) as err:
        build_file_config(str(_write(tmp_path, "bad.json", data)))
    assert _fields(err.value) == {"train.recompute"}


def test_a_resume_continues_the_checkpoints_schedule_unless_told_otherwise():
    """A resumed run follows the learning-rate schedule its checkpoint recorded (as Megatron does: a longer --steps
    does not stretch the decay); a schedule setting the user gives wins, and the resume says so."""
    from hfsdp.cli.rank.resume import schedule_settings

    saved = {"lr": 1e-3, "min_lr": 1e-4, "warmup_iters": 2, "decay_iters": 10, "style": "cosine"}
    fresh = _build({"steps": 30})
    assert schedule_settings(fresh, None) == (
        {"lr": 3e-3, "min_lr": 0.0, "warmup_iters": 0, "decay_iters": 30, "style": "constant"},
        [],
    )
    assert schedule_settings(fresh, saved) == (saved, [])
    told = _build({"steps": 30, "lr": 5e-4, "lr_decay_iters": 30})
    settings, notes = schedule_settings(told, saved)
    assert settings == {**saved, "lr": 5e-4, "decay_iters": 30}
    assert notes == [
        "--lr 0.0005 instead of the checkpoint's 0.001",
        "--lr-decay-iters 30 instead of the checkpoint's 10",
    ]


# What megatron-core, transformers and the data refuse, and the bounds on sizes ---------------------------------

REFUSED = {
    "top-1 routing": ({"num_moe_experts": 2, "moe_topk": 1}, "--moe-topk", "refuses top-1 routing"),
    "an odd rotary head dim": ({"hidden": 12, "heads": 4}, "--hidden", "4 heads of 3 channels, an odd number"),
    "a one-token vocabulary": ({"vocab": 1}, "--vocab", "--vocab 1 must be at least 2"),
    "a vocabulary of 1e9": ({"vocab": 10**9}, "--vocab", "is above 4,194,304, the largest vocabulary size"),
    "a million layers": ({"layers": 10**6}, "--layers", "--layers 1000000 is above 1,024"),
    "2,000 experts": ({"num_moe_experts": 2000}, "--moe-experts", "--moe-experts 2000 is above 1,024"),
    "a global batch of 2^40": ({"global_batch_size": 2**40}, "--global-batch-size", "global batches of"),
    "sequences of 1e8": ({"seq_len": 10**8}, "--seq-len", "--seq-len 100000000 is above 1,048,576"),
    "microbatches of 2^25 tokens": (
        {"seq_len": 8, "micro_batch_size": 2**22, "global_batch_size": 2**24},
        "--micro-batch-size",
        "microbatches of 33,554,432 tokens",
    ),
    "unfused attention of 2^34 scores": ({"seq_len": 2**16, "micro_batch_size": 1}, "--seq-len", "attention scores"),
    "a vocabulary above the bound in a large model": (
        {"hidden": 65536, "vocab": 5_000_000},
        "--vocab",
        "parameters, 3.0 TB in fp32",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_would_fail_inside_a_rank_is_refused_by_the_rules(case):
    """Each of these used to be valid and then failed in every rank (megatron-core's refusal, a shape mismatch, the
    allocator) or made no progress; now it is one problem under its flag, saying why and, for sizes, what the run
    would need."""
    flags, flag, words = REFUSED[case]
    with pytest.raises(ConfigError) as err:
        _build(flags)
    assert _fields(err.value) == {flag}, err.value.problems
    assert words in err.value.problems[0].message


def test_sizes_at_the_bounds_are_valid():
    """The bounds themselves are allowed: a 2-token vocabulary, top-2 of 2 experts, head dimension 2, sequences of
    the bound's length with a micro batch of one."""
    assert _build({"vocab": 2, "num_moe_experts": 2, "moe_topk": 2, "hidden": 8, "heads": 4}).vocab == 2
    assert _build({"seq_len": 2**14, "micro_batch_size": 1, "heads": 1, "hidden": 2, "global_batch_size": 4}).seq_len


def test_docs_list_the_bounds_the_code_applies():
    """docs/cli.md's table of bounds is the code's (hfsdp.models.sizes), row for row."""
    from pathlib import Path

    from hfsdp.models import sizes

    docs = (Path(__file__).resolve().parents[3] / "docs" / "cli.md").read_text()
    rows = [line.split("|")[1:-1] for line in docs.splitlines() if line.startswith("| ") and line.count("|") == 6]
    table = {cells[0].strip(): (cells[3].strip(), cells[4].strip()) for cells in rows[1:]}
    expected = {what: (str(least), f"{most:,}") for least, most, what in sizes.LIMITS.values()}
    names = {"vocabulary size": "vocabulary", "MLP (intermediate) size": "MLP size", "number of layers": "layers",
             "number of attention heads": "attention heads", "number of key/value heads": "key/value heads",
             "number of experts": "experts"}  # fmt: skip
    assert {names.get(k, k): v for k, v in expected.items()} == table
    for bound in (
        sizes.MAX_BATCH_TOKENS,
        sizes.MAX_MICROBATCH_TOKENS,
        sizes.MAX_ATTENTION_SCORES,
    ):
        assert f"{bound:,}" in docs


# How problems read --------------------------------------------------------------------------------------


def test_messages_name_the_flag_once_and_leak_no_python_types():
    """`hfsdp train --outer optm --dtype fp16 --nproc 0 --lr-decay-style cosin`: each line names its flag once, quotes
    values as written (no "(text)", no "(int)"), and suggests the choice meant; the text '8' is called text."""
    from typer.testing import CliRunner

    from hfsdp.cli.main import app

    result = CliRunner().invoke(app, ["train", "--outer", "optm", "--dtype", "fp16", "--nproc", "0",
                                      "--lr-decay-style", "cosin", "--device", "cpu"])  # fmt: skip
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()[1:]
    assert sorted(lines) == sorted([
        "  - --outer is 'optm', which is not allowed: 'optm' is not a strategy. Did you mean 'optim'? Use one "
        "of no_shard, optim, optim_grads, optim_grads_params, diloco.",
        "  - --dtype must be one of fp32, bf16; got 'fp16'.",
        "  - --nproc must be a positive integer, got 0; write a whole number such as 1, 2 or 8.",
        "  - --lr-decay-style must be one of constant, linear, cosine (did you mean cosine?); got 'cosin'.",
    ])  # fmt: skip
    with pytest.raises(ConfigError) as err:
        _build({"steps": "8"})
    assert err.value.problems[0].message.endswith("got the text '8'.")


def test_zero_names_are_accepted_for_the_megatron_strategies():
    """zero1/zero2/zero3/ddp (any case, with - or _), the names the README and DeepSpeed use, mean optim,
    optim_grads, optim_grads_params and no_shard."""
    cfg = _build({"inner": "zero3", "outer": "ZeRO-1", "instances": 2})
    assert cfg.layout.layout_name == "HFSDP 2x2 (optim over optim_grads_params)"
    assert _build({"inner": "zero_2", "outer": "DDP", "instances": 2}).layout.inner == "optim_grads"


def test_the_summary_says_1_step():
    """One step is "1 step", not "1 steps"."""
    import io
    from contextlib import redirect_stdout

    import torch

    from hfsdp.cli.rank.throughput import Throughput
    from hfsdp.cli.rank.train_loop import _print_summary

    summary = {"layout": "ZeRO-3 1x4", "steps": 1, "final_loss": 1.0, "tokens_per_s": 10.0,
               "peak_memory_mb_per_rank": [1.0]}  # fmt: skip
    out = io.StringIO()
    cfg = _build({"steps": 1})
    with redirect_stdout(out):
        _print_summary(cfg, summary, torch.device("cpu"), Throughput.of(cfg, torch.device("cpu")))
    assert "ZeRO-3 1x4, 1 step, final loss" in out.getvalue()
