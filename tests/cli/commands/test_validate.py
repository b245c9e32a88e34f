"""`hfsdp validate-config` and the config-file loader, in-process and as the installed command."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hfsdp.cli.main import app
from hfsdp.cli.settings.config_file import ConfigFileError, read_config_file
from hfsdp.cli.settings.train_config import build_file_config
from hfsdp.core.rules.config import ConfigError, LayoutConfig

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "hfsdp_2x4.yaml"
HFSDP = Path(sys.executable).parent / "hfsdp"

#: The issue's example as data, written out below as YAML, TOML and JSON.
ISSUE = {
    "parallel": {"world_size": 8, "tensor_model_parallel_size": 1, "expert_model_parallel_size": 2},
    "ddp": {
        "data_parallel_sharding_strategy": "optim_grads_params",
        "outer_dp_sharding_strategy": "optim",
        "num_distributed_optimizer_instances": 2,
        "expert_data_parallel_sharding_strategy": "optim_grads",
    },
    "model": {"num_moe_experts": 8},
    "train": {"global_batch_size": 64, "micro_batch_size": 2},
}

runner = CliRunner()


def write(tmp_path: Path, name: str, data: dict | str) -> Path:
    """Write `data` (a mapping, or raw text) to tmp_path/name in the format its extension names."""
    path = tmp_path / name
    if isinstance(data, str):
        path.write_text(data)
    elif path.suffix == ".json":
        path.write_text(json.dumps(data))
    elif path.suffix == ".toml":
        lines = []
        for section, body in data.items():
            lines.append(f"[{section}]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in body.items()]
        path.write_text("\n".join(lines) + "\n")
    else:
        import yaml

        path.write_text(yaml.safe_dump(data))
    return path


def with_(section: str, key: str, value) -> dict:
    """The issue's example with section.key set to value."""
    data = json.loads(json.dumps(ISSUE))
    data.setdefault(section, {})[key] = value
    return data


def invoke(*args: str | Path):
    return runner.invoke(app, ["validate-config", *map(str, args)])


def invoke_json(*args: str | Path) -> tuple[int, dict]:
    result = invoke(*args, "--format", "json")
    return result.exit_code, json.loads(result.stdout)


# Valid files --------------------------------------------------------------------------------------


def test_example_file_is_the_issue_example():
    """examples/hfsdp_2x4.yaml, which the README points at, holds exactly the issue's example."""
    import yaml

    assert yaml.safe_load(EXAMPLE.read_text()) == ISSUE


def test_valid_text_summary():
    """A valid file exits 0 and prints the layout, meshes, placements, bytes per parameter and microbatches."""
    result = invoke(EXAMPLE)
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "is a valid hfsdp config" in out
    assert "HFSDP 2x4 (optim over optim_grads_params)" in out
    assert "dp_outer=2 x dp_shard=4" in out and "expert_dp=4" in out
    assert "(Replicate(), Shard(0))" in out and "(Partial(), Shard(0))" in out and "(Shard(0), Shard(0))" in out
    assert "expert parameters (ep=2)" in out
    assert "2.5" in out and "5.5" in out
    assert "4 microbatch(es) of 2" in out


@pytest.mark.parametrize("name", ["cfg.yaml", "cfg.yml", "cfg.toml", "cfg.json"])
def test_formats_give_the_same_summary(tmp_path, name):
    """YAML, TOML and JSON files with the same content give the same JSON summary."""
    code, reference = invoke_json(EXAMPLE)
    assert code == 0
    code, report = invoke_json(write(tmp_path, name, ISSUE))
    assert code == 0
    assert report == reference


def test_valid_json_summary():
    """--format json prints one object with valid true, no errors and the layout's numbers."""
    code, report = invoke_json(EXAMPLE)
    assert code == 0
    assert (report["valid"], report["errors"]) == (True, [])
    s = report["summary"]
    assert s["layout"] == "HFSDP 2x4 (optim over optim_grads_params)"
    assert s["dense"]["mesh"] == {"names": ["dp_outer", "dp_shard"], "shape": [2, 4]}
    assert s["dense"]["placements"] == {
        "param": "(Replicate(), Shard(0))",
        "grad": "(Partial(), Shard(0))",
        "optim": "(Shard(0), Shard(0))",
    }
    assert s["dense"]["bytes_per_param"] == pytest.approx(4 / 4 + 12 / 8)
    assert s["expert"]["mesh"] == {"names": ["expert_dp"], "shape": [4]}
    assert s["expert"]["placements"] == {"param": "(Replicate())", "grad": "(Shard(0))", "optim": "(Shard(0))"}
    assert s["expert"]["bytes_per_param"] == pytest.approx(2 + 2 / 4 + 12 / 4)
    assert s["num_microbatches"] == 4
    assert s["config"]["ddp.outer_dp_sharding_strategy"] == "optim"


def test_dense_only_file_has_no_expert_summary(tmp_path):
    """Without num_moe_experts the summary has no expert part; absent batch sizes are hfsdp train's defaults."""
    path = write(tmp_path, "dense.yaml", {"parallel": {"world_size": 4}})
    code, report = invoke_json(path)
    assert code == 0
    assert report["summary"]["expert"] is None
    assert (report["summary"]["num_microbatches"], report["summary"]["global_batch_size"]) == (2, 16)
    assert report["summary"]["layout"] == "ZeRO-3 1x4 (optim_grads_params)"
    assert report["summary"]["settings"]["train.lr"] == {"value": 3e-3, "default": True}
    assert "expert parameters" not in invoke(path).stdout


def test_world_size_override(tmp_path):
    """--world-size replaces the file's world size, and supplies it when the file has none."""
    code, report = invoke_json(EXAMPLE, "--world-size", "4")
    assert code == 0
    assert report["summary"]["world_size"] == 4
    assert report["summary"]["layout"] == "HFSDP 2x2 (optim over optim_grads_params)"
    data = json.loads(json.dumps(ISSUE))
    del data["parallel"]["world_size"]
    path = write(tmp_path, "nows.yaml", data)
    code, report = invoke_json(path)
    assert code == 1
    assert report["errors"][0]["field"] == "parallel.world_size"
    assert "--world-size" in report["errors"][0]["message"]
    assert invoke(path, "--world-size", "16").exit_code == 0


def test_missing_world_size_is_reported_with_the_other_problems(tmp_path):
    """Without a world size the remaining checks still run: a bad strategy is reported alongside it."""
    data = with_("ddp", "outer_dp_sharding_strategy", "optm")
    del data["parallel"]["world_size"]
    code, report = invoke_json(write(tmp_path, "nows.json", data))
    assert code == 1
    errors = {e["field"]: e["message"] for e in report["errors"]}
    assert set(errors) == {"parallel.world_size", "ddp.outer_dp_sharding_strategy"}
    assert errors["parallel.world_size"].startswith("parallel.world_size is missing")


def test_bad_world_size_override_is_named_as_the_flag():
    """An invalid --world-size is reported against the flag, not the file key."""
    code, report = invoke_json(EXAMPLE, "--world-size", "0")
    assert code == 1
    assert [e["field"] for e in report["errors"]] == ["--world-size"]


# Invalid files ------------------------------------------------------------------------------------


def test_invalid_file_lists_every_problem(tmp_path):
    """An invalid file exits 1 and lists each problem under the file's dotted key names."""
    data = with_("ddp", "data_parallel_sharding_strategy", "optim_grad")
    data["parallel"]["tensor_model_parallel_size"] = 2
    data["ddp"]["num_distributed_optimizer_instances"] = 3
    path = write(tmp_path, "bad.yaml", data)
    result = invoke(path)
    assert result.exit_code == 1
    assert "is not a valid hfsdp config (3 problems)" in result.stdout
    assert "  - ddp.data_parallel_sharding_strategy " in result.stdout
    assert "Did you mean 'optim_grads'?" in result.stdout
    assert "  - parallel.tensor_model_parallel_size " in result.stdout
    assert "  - ddp.num_distributed_optimizer_instances " in result.stdout
    assert "Traceback" not in result.output


def test_invalid_json_report(tmp_path):
    """--format json on an invalid file gives valid false, one error per problem and a null summary."""
    data = with_("ddp", "data_parallel_sharding_strategy", "optim")
    data["ddp"]["outer_dp_sharding_strategy"] = "optim_grads"
    code, report = invoke_json(write(tmp_path, "bad.json", data))
    assert code == 1
    assert (report["valid"], report["summary"]) == (False, None)
    assert [e["field"] for e in report["errors"]] == ["ddp.outer_dp_sharding_strategy"]
    assert "cross instances" in report["errors"][0]["message"]


@pytest.mark.parametrize(
    ("section", "key", "field", "suggestion"),
    [
        ("ddp", "outer_dp_sharding_stratgy", "ddp.outer_dp_sharding_stratgy", "outer_dp_sharding_strategy"),
        ("parallel", "world_sise", "parallel.world_sise", "world_size"),
        ("train", "micro_batchsize", "train.micro_batchsize", "micro_batch_size"),
        ("model", "num_layer", "model.num_layer", "num_layers"),
    ],
)
def test_unknown_key_is_named_with_a_suggestion(tmp_path, section, key, field, suggestion):
    """A misspelt key is an error naming it and suggesting the key it resembles."""
    code, report = invoke_json(write(tmp_path, "typo.yaml", with_(section, key, 2)))
    assert code == 1
    errors = {e["field"]: e["message"] for e in report["errors"]}
    assert field in errors
    assert f"Did you mean '{suggestion}'?" in errors[field]


def test_unknown_section_is_named(tmp_path):
    """An unknown top-level section is an error naming it, reported together with layout problems."""
    data = json.loads(json.dumps(ISSUE))
    data["paralel"] = {"world_size": 8}
    data["train"]["global_batch_size"] = 60
    code, report = invoke_json(write(tmp_path, "typo.toml", data))
    assert code == 1
    errors = {e["field"]: e["message"] for e in report["errors"]}
    assert set(errors) == {"paralel", "train.global_batch_size"}
    assert "Did you mean 'parallel'?" in errors["paralel"]


def test_section_that_is_not_a_mapping(tmp_path):
    """A section holding a list instead of keys is an error naming the section."""
    code, report = invoke_json(write(tmp_path, "list.yaml", "parallel:\n  world_size: 8\nddp: [optim]\n"))
    assert code == 1
    assert report["errors"][0]["field"] == "ddp"
    assert "mapping" in report["errors"][0]["message"]


def test_layout_sizes_are_not_coerced_from_strings(tmp_path):
    """A quoted number or a boolean for a layout size is rejected, not silently converted."""
    code, report = invoke_json(write(tmp_path, "str.yaml", 'parallel:\n  world_size: "8"\n'))
    assert code == 1
    assert report["errors"][0]["field"] == "parallel.world_size"
    code, report = invoke_json(write(tmp_path, "bool.json", with_("ddp", "num_distributed_optimizer_instances", True)))
    assert code == 1
    assert report["errors"][0]["field"] == "ddp.num_distributed_optimizer_instances"


# Unreadable files ---------------------------------------------------------------------------------

UNPARSEABLE = [
    ("broken.yaml", "parallel: [8\n", "not valid YAML"),
    ("broken.toml", "[parallel\nworld_size = 8\n", "not valid TOML"),
    ("broken.json", '{"parallel": {"world_size": 8}', "not valid JSON"),
    ("dup.yaml", "parallel:\n  world_size: 8\n  world_size: 4\n", "'world_size' appears a second time"),
    ("dup.json", '{"parallel": {"world_size": 8, "world_size": 4}}', "'world_size' appears twice"),
    ("list.json", "[1, 2]", "not a mapping"),
    ("empty.yaml", "", "empty"),
    ("config.ini", "[parallel]\n", "extension '.ini'"),
]


@pytest.mark.parametrize(("name", "text", "reason"), UNPARSEABLE)
def test_unparseable_file_exits_2(tmp_path, name, text, reason):
    """A file that cannot be read as a mapping exits 2 with one paragraph naming the file and why, no traceback."""
    path = write(tmp_path, name, text)
    result = invoke(path)
    assert result.exit_code == 2
    assert result.stdout == ""
    assert f"'{path}'" in result.stderr and reason in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.output


def test_missing_file_exits_2_in_both_formats(tmp_path):
    """A missing file exits 2; in JSON it is one error with field 'file' and a null summary."""
    path = tmp_path / "nope.yaml"
    result = invoke(path)
    assert result.exit_code == 2
    assert f"'{path}'" in result.stderr and "no such file" in result.stderr
    code, report = invoke_json(path)
    assert code == 2
    assert report["valid"] is False and report["summary"] is None
    assert len(report["errors"]) == 1 and report["errors"][0]["field"] == "file"
    assert str(path) in report["errors"][0]["message"]


def test_directory_exits_2(tmp_path):
    """A directory given as the config file exits 2 rather than crashing."""
    (tmp_path / "d.yaml").mkdir()
    result = invoke(tmp_path / "d.yaml")
    assert result.exit_code == 2
    assert "directory" in result.stderr


# Hostile files: every input gets a message and exit 1 or 2, fast, never a traceback --------------

#: A "billion laughs": 9 levels of 9 aliases each, about 500 bytes that expand to 9**9 values.
ALIAS_BOMB = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi", strict=True)
)

HOSTILE = [
    ("deep.yaml", "a: " + "[" * 600 + "]" * 600, 2, "levels deep"),
    ("deep_block.yaml", "".join("  " * i + f"k{i}:\n" for i in range(600)), 2, "levels deep"),
    ("deep.json", "[" * 100_000 + "]" * 100_000, 2, "levels deep"),
    ("deep.toml", "a = " + "[" * 5000 + "]" * 5000, 2, "levels deep"),
    ("bomb.yaml", ALIAS_BOMB, 2, "alias bomb"),
    ("cycle.yaml", "a: &a [*a]\n", 2, "cycle"),
    ("big.yaml", "a: " + "x" * (2 << 20), 2, "larger than 1 MiB"),
    ("binary.yaml", bytes(range(256)), 2, "not UTF-8"),
    ("object.yaml", "a: !!python/object:os.system ls\n", 2, "not valid YAML"),
    ("huge.json", '{"parallel": {"world_size": ' + "9" * 4301 + "}}", 1, "4301-digit integer"),
    ("huge.yaml", "parallel: {world_size: " + "9" * 4301 + "}\n", 1, "4301-digit integer"),
    ("huge.toml", "[parallel]\nworld_size = " + "9" * 4301 + "\n", 1, "4301-digit integer"),
    ("nan.yaml", "parallel: {world_size: 8}\ntrain: {lr: .nan}\n", 1, "train.lr must be a positive number"),
    ("inf.json", '{"parallel": {"world_size": 8}, "train": {"clip_grad": Infinity}}', 1, "train.clip_grad must be"),
    ("keys.yaml", "parallel: {world_size: 8}\n1: 2\nnull: 3\n", 1, "'None' is not a section"),
]


@pytest.mark.parametrize(("name", "text", "code", "reason"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_file_is_refused_fast_with_one_message(tmp_path, name, text, code, reason):
    """Deep nesting, alias bombs, huge files and integers, binary, objects, NaN, odd keys: a message, exit 1 or 2,
    in well under a second, never a traceback."""
    path = tmp_path / name
    path.write_bytes(text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text)
    began = time.monotonic()
    result = invoke(path)
    assert time.monotonic() - began < 10  # no hang and no unbounded read (a bound for a loaded box, not a speed)
    assert result.exit_code == code, result.output
    assert reason in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output


def test_yaml_merge_keys_are_supported(tmp_path):
    """`<<: *anchor` merges a mapping (explicit keys win); the merged keys are checked like written ones."""
    text = "parallel: {world_size: 8}\nddp:\n  <<: {num_distributed_optimizer_instances: 2}\n"
    text += "  outer_dp_sharding_strategy: optim\n"
    code, report = invoke_json(write(tmp_path, "merge.yaml", text))
    assert code == 0, report
    assert report["summary"]["layout"] == "HFSDP 2x4 (optim over optim_grads_params)"
    text = "base: &b {world_size: 8}\nparallel:\n  <<: *b\n  world_size: 4\n"
    code, report = invoke_json(write(tmp_path, "override.yaml", text))
    assert [e["field"] for e in report["errors"]] == ["base"]  # only the unknown section, not the merge


def test_lone_surrogates_and_escapes_print_in_text_mode(tmp_path):
    """Keys and values holding lone surrogates or terminal escapes are reported escaped, in text and in JSON."""
    path = write(tmp_path, "s.json", '{"parallel": {"world_size": 8}, "\\ud800": 1, "train": {"lr": "\\u001b[2J"}}')
    proc = run_hfsdp("validate-config", path)
    assert proc.returncode == 1, proc.stderr
    assert "\\ud800" in proc.stdout and "\\x1b[2J" in proc.stdout and "\x1b" not in proc.stdout
    assert "Traceback" not in proc.stderr
    proc = run_hfsdp("validate-config", path, "--format", "json")
    assert proc.returncode == 1 and len(json.loads(proc.stdout)["errors"]) == 2


def test_fuzzed_files_never_crash(tmp_path):
    """Three hundred seeded random configs and byte mutations of them: every one exits 0, 1 or 2, no exception."""
    import random

    import yaml

    rng = random.Random(11)
    keys = ["parallel.world_size", "ddp.outer_dp_sharding_strategy", "ddp.num_distributed_optimizer_instances"]
    keys += ["model.num_moe_experts", "model.hidden_size", "train.lr", "train.dtype", "train.global_batch_size"]
    values = [0, 1, 2, 8, -1, 10**30, 1.5, float("nan"), "optim", "fp16", "", None, True, [1], {"a": 1}, "\x00"]
    codes = set()
    for i in range(300):
        data: dict = {}
        for key in rng.sample(keys, rng.randint(0, len(keys))):
            section, name = key.split(".")
            data.setdefault(section, {})[name] = rng.choice(values)
        suffix = rng.choice([".yaml", ".json"])
        raw = (yaml.safe_dump(data) if suffix == ".yaml" else json.dumps(data)).encode()
        if i % 2:
            raw = bytearray(raw)
            for _ in range(rng.randint(1, 4)):
                raw[rng.randrange(len(raw))] = rng.choice(b"[]{}:,&*!-#\n 9\xff")
        path = tmp_path / f"f{i}{suffix}"
        path.write_bytes(bytes(raw))
        result = invoke(path)
        assert result.exception is None or isinstance(result.exception, SystemExit), (path.read_bytes(), result)
        assert result.exit_code in (0, 1, 2)
        codes.add(result.exit_code)
    assert codes == {0, 1, 2}


# The loader's API, shared with `hfsdp train` -----------------------------------------------------


def test_build_file_config_returns_layout_and_settings(tmp_path):
    """build_file_config returns the layout plus the trainer's settings, YAML's '1e-4' read as a number."""
    text = EXAMPLE.read_text() + "  lr: 1e-4\n  train_iters: 10\n  dtype: bf16\n  clip_grad: 1.0\n  seed: 0\n"
    text = text.replace("model:\n", "model:\n  num_layers: 2\n  hidden_size: 64\n")
    cfg = build_file_config(str(write(tmp_path, "full.yaml", text)))
    assert isinstance(cfg.layout, LayoutConfig)
    assert cfg.layout.num_moe_experts == 8 and cfg.layout.instances == 2
    assert (cfg.layers, cfg.hidden, cfg.lr, cfg.steps, cfg.dtype, cfg.clip_grad) == (2, 64, 1e-4, 10, "bf16", 1.0)
    assert cfg.explicit("lr") and not cfg.explicit("heads")


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("train.lr", "fast"),
        ("train.lr", 0),
        ("train.seed", -1),
        ("train.dtype", "float16"),
        ("train.dtype", "fp16"),
        ("model.num_layers", 0),
    ],
)
def test_bad_setting_values_are_problems(tmp_path, key, value):
    """A wrong value for a model or train key is a problem naming the key, alongside layout problems."""
    section, name = key.split(".")
    data = with_(section, name, value)
    data["ddp"]["num_distributed_optimizer_instances"] = 3
    with pytest.raises(ConfigError) as info:
        build_file_config(str(write(tmp_path, "x.json", data)))
    assert {p.field for p in info.value.problems} == {key, "ddp.num_distributed_optimizer_instances"}


def test_read_config_file_raises_config_file_error(tmp_path):
    """An unreadable file raises ConfigFileError carrying the path."""
    with pytest.raises(ConfigFileError) as info:
        read_config_file(tmp_path / "missing.toml")
    assert info.value.path == str(tmp_path / "missing.toml")


# The installed command ----------------------------------------------------------------------------


def run_hfsdp(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(HFSDP), *map(str, args)], capture_output=True, text=True, timeout=120)


def test_installed_command_validates_the_example():
    """The installed `hfsdp` script validates the example file with exit 0."""
    proc = run_hfsdp("validate-config", EXAMPLE)
    assert proc.returncode == 0, proc.stderr
    assert "HFSDP 2x4 (optim over optim_grads_params)" in proc.stdout


def test_installed_command_reports_unreadable_file_as_json(tmp_path):
    """The installed command prints one JSON object and exits 2 on an unparseable file, without a traceback."""
    proc = run_hfsdp("validate-config", write(tmp_path, "b.toml", "x = [\n"), "--format", "json")
    assert proc.returncode == 2
    assert json.loads(proc.stdout)["errors"][0]["field"] == "file"
    assert "Traceback" not in proc.stderr


def test_help_lists_validate_config_without_importing_torch():
    """`hfsdp --help` lists validate-config, and importing the app loads neither torch nor megatron."""
    proc = run_hfsdp("--help")
    assert proc.returncode == 0
    assert "validate-config" in proc.stdout
    code = (
        "import sys, hfsdp.cli.main; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'megatron', 'numpy'}))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_validate_config_imports_neither_torch_nor_megatron():
    """`hfsdp validate-config` on a valid file answers without importing torch or megatron (a CI tool stays fast)."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "hfsdp.cli", "validate-config", str(EXAMPLE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "is a valid hfsdp config" in proc.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "hfsdp.core.rules.layout" in imported  # the summary was computed in this process
    assert not {m for m in imported if m.split(".")[0] in ("torch", "megatron")}


def test_placement_names_match_torch_placements():
    """The torch-free placement names validate-config prints are exactly torch's placements, for every layout."""
    import itertools

    from hfsdp.core.rules.layout import dense_layout
    from hfsdp.core.rules.placement import describe
    from hfsdp.core.rules.placement_names import describe_names
    from hfsdp.core.rules.strategy import Strategy

    for outer, inner in itertools.product(Strategy, Strategy.sharding()):
        if outer.level > inner.level:
            continue
        mesh = dense_layout(LayoutConfig(world_size=4, inner=inner, outer=outer, instances=2))
        for state in ("param", "grad", "optim"):
            assert describe_names(mesh.placement_names(state)) == describe(mesh.placements.of(state))


def test_a_fifo_or_device_as_the_config_file_is_refused_at_once(tmp_path):
    """A FIFO (whose open blocks until someone writes) or a device named as the config file is refused at once by
    validate-config and by train --config, exit 2, naming the file, instead of hanging or reading forever."""
    import os

    fifo = tmp_path / "run.yaml"
    os.mkfifo(fifo)
    device = tmp_path / "zero.yaml"
    device.symlink_to("/dev/zero")
    for path in (fifo, device):
        for command in (["validate-config", str(path)], ["train", "--config", str(path)]):
            result = subprocess.run([str(HFSDP), *command], capture_output=True, text=True, timeout=30)
            assert result.returncode == 2, result.stderr
            assert "is not a regular file (a FIFO, device or socket)" in result.stderr and str(path) in result.stderr


def test_the_bytes_per_parameter_count_the_precision_aware_optimizer_dtypes(tmp_path):
    """With bf16 / fp8 moments the summary counts 4 + 2 + (1 + 4/128) bytes of main weights and Adam state per
    element (fp8's scale per 128 beside it), and says so; without the flag the fp32 12."""
    train = {"use_precision_aware_optimizer": True, "exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "fp8"}
    code, report = invoke_json(write(tmp_path, "precision.yaml", {**ISSUE, "train": {**ISSUE["train"], **train}}))
    assert code == 0, report
    s = report["summary"]
    optim = 4 + 2 + 1 + 4 / 128
    assert s["dense"]["bytes_per_param"] == pytest.approx(4 / 4 + optim / 8)
    assert s["expert"]["bytes_per_param"] == pytest.approx(2 + 2 / 4 + optim / 4)
    assert s["bytes_per_param_assumes"] == "bf16 params and grads, fp32 main weights, Adam state bf16/fp8"
    code, plain = invoke_json(write(tmp_path, "plain.yaml", ISSUE))
    assert plain["summary"]["dense"]["bytes_per_param"] == pytest.approx(4 / 4 + 12 / 8)
