"""Hugging Face in and out, offline: import a save_pretrained directory, export --format hf|megatron, model records.

Tiny transformers models (hidden 32, 2 layers, vocab 128, grouped-query
attention), tied and untied, fp32 and bf16, one file and sharded, Llama and
Qwen2 (attention biases). Loading imported checkpoints into sharded models, an
online save exported to HF, and the megatron GPT's Llama mapping checked
against megatron's forward are in tests/ckpt/test_hf_distributed.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from hfsdp.ckpt import (
    CheckpointError,
    GroupSpec,
    export,
    import_hf,
    inspect,
    read_index,
    reshard,
    verify,
    write_from_tensors,
)
from hfsdp.ckpt.format.index import MAIN, MODEL
from hfsdp.ckpt.hf.directory import read_hf_dir
from hfsdp.ckpt.hf.source import HFSource
from hfsdp.cli.commands.ckpt import app
from hfsdp.core.rules.config import LayoutConfig
from hfsdp.models.megatron.gpt import GPTShape

from tests.support.ckpt_files import edit_index, synthetic_checkpoint, synthetic_groups
from tests.support.hf_dirs import (
    LAYOUTS,
    MODELS,
    TINY,
    TOKENS,
    hf_logits,
    hf_tensors,
    load_info,
    tiny_config,
    write_hf_dir,
)

runner = CliRunner()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {
        name: write_hf_dir(root / name.replace(" ", "-"), model_type, tied, dtype, shard)
        for name, (model_type, tied, dtype, shard) in MODELS.items()
    }


# -- import, then export: the round trip -------------------------------------------------------


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("model", list(MODELS))
def test_import_then_export_is_bit_identical(hf_dirs, tmp_path, model, layout):
    """HF dir -> import (any layout) -> export --format hf in the files' dtype: the same tensors bit for bit,
    which from_pretrained loads with nothing missing or unexpected, giving the original model's logits."""
    src, dtype = hf_dirs[model], MODELS[model][2]
    import_hf(src, tmp_path / "ckpt", LayoutConfig(**LAYOUTS[layout]))
    verify(tmp_path / "ckpt")
    out = tmp_path / "out"
    result = export(tmp_path / "ckpt", out, "fp32" if dtype == torch.float32 else "bf16", max_shard_bytes=30_000)
    assert result.format == "hf" and result.files > 1
    original, exported = hf_tensors(src), hf_tensors(out)
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    _, info = load_info(out)
    assert info["missing_keys"] == info["unexpected_keys"] == set() and not info["mismatched_keys"]
    assert torch.equal(hf_logits(out), hf_logits(src))


def test_imported_index_is_step_0_weights_only_with_the_models_groups(hf_dirs, tmp_path):
    """Step 0, kinds model (compute dtype) and main (fp32, cast from bf16 files), no optimizer, one group per
    decoder layer and the root last, the tied weight once under its first name, the transformers record."""
    src = hf_dirs["llama bf16 sharded"]
    import_hf(src, tmp_path / "ckpt", LayoutConfig(world_size=4), compute_dtype="bfloat16")
    index = read_index(tmp_path / "ckpt")
    assert index.step == 0 and index.optimizer is None and index.kinds == [MODEL, MAIN] and index.extra == {}
    assert [(g.unit_index, g.dtype, g.is_expert) for g in index.groups] == [(i, "bfloat16", False) for i in range(3)]
    assert index.groups[0].members[0][0] == "model.layers.0.self_attn.q_proj.weight"
    assert [n for n, _ in index.groups[2].members] == [
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]
    assert {t.dtype for t in index.tensors[MAIN].values()} == {"float32"}
    assert {t.dtype for t in index.tensors[MODEL].values()} == {"bfloat16"}
    assert index.model["format"] == "transformers" and index.model["config"]["model_type"] == "llama"
    assert index.unsharded == {} and index.order[0] == "model.embed_tokens.weight"

    import_hf(hf_dirs["llama tied sharded"], tmp_path / "tied", LayoutConfig(world_size=2))
    tied = read_index(tmp_path / "tied")
    assert [n for n, _ in tied.groups[-1].members] == ["model.embed_tokens.weight", "model.norm.weight"]
    assert "lm_head.weight" not in tied.order and tied.model["config"]["tie_word_embeddings"] is True


def test_import_and_export_leave_the_callers_rng_alone(hf_dirs, tmp_path):
    """Building the meta model seeds torch's generator; the caller's state is restored."""
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    import_hf(hf_dirs["llama untied"], tmp_path / "ckpt", LayoutConfig(world_size=2))
    export(tmp_path / "ckpt", tmp_path / "out")
    assert torch.equal(torch.rand(3), expected)


def test_bf16_files_become_exact_fp32_main_weights(hf_dirs, tmp_path):
    """Casting bf16 to fp32 is exact: the main weights equal the file's tensors."""
    from hfsdp.ckpt.tensors.reader import CheckpointReader

    src = hf_dirs["llama bf16 sharded"]
    import_hf(src, tmp_path / "ckpt", LayoutConfig(world_size=6, instances=3, outer="optim"))
    index = read_index(tmp_path / "ckpt")
    with CheckpointReader(tmp_path / "ckpt", index) as reader:
        for name, tensor in hf_tensors(src).items():
            main = torch.empty(tensor.numel())
            reader.read_into(MAIN, name, 0, main)
            assert torch.equal(main, tensor.float().reshape(-1)), name


def test_hf_source_reads_any_flat_range_in_small_chunks(hf_dirs):
    """A flat range of an N-D tensor, in chunks of 7 elements, cast to the target dtype, is the same range."""
    hf = read_hf_dir(hf_dirs["llama bf16 sharded"])
    name = "model.layers.1.self_attn.k_proj.weight"
    source = HFSource(hf, {(MAIN, name): "float32"})
    flat = hf_tensors(hf.path)[name].float().reshape(-1)
    for start, stop in [(0, flat.numel()), (5, 300), (31, 32)]:
        chunks = list(source.chunks(MAIN, name, start, stop, 7))
        assert max(c.numel() for c in chunks) <= 7 and all(c.dtype == torch.float32 for c in chunks)
        assert torch.equal(torch.cat(chunks), flat[start:stop])
    source.close()


def test_export_dtypes_and_config(hf_dirs, tmp_path):
    """By default the model's own dtype (fp32 here, so the round trip is exact), bf16 or fp16 on request; config.json
    names the architecture and the dtype from_pretrained gets."""
    from transformers import AutoModelForCausalLM

    import_hf(hf_dirs["llama untied"], tmp_path / "ckpt", LayoutConfig(world_size=2))
    for dtype, expected in [(None, torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)]:
        out = tmp_path / str(dtype)
        assert export(tmp_path / "ckpt", out, dtype).dtype == {torch.float32: "fp32"}.get(expected, dtype)
        config = json.loads((out / "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLM"]
        assert config["dtype"] == config["torch_dtype"] == str(expected).removeprefix("torch.")
        assert {t.dtype for t in hf_tensors(out).values()} == {expected}
        model = AutoModelForCausalLM.from_pretrained(out)
        assert next(model.parameters()).dtype == expected
    original = hf_tensors(hf_dirs["llama untied"])
    assert all(torch.equal(t, original[name]) for name, t in hf_tensors(tmp_path / "None").items())


def test_export_defaults_to_the_models_own_dtype(hf_dirs, tmp_path):
    """A bf16 Hugging Face model exports as bf16 and is not touched by --compute-dtype; a checkpoint without a
    transformers config exports in the compute dtype it trained in (its groups' dtype); the CLI says which."""
    import_hf(hf_dirs["llama bf16 sharded"], tmp_path / "bf16", LayoutConfig(world_size=2))
    assert export(tmp_path / "bf16", tmp_path / "bf16-out").dtype == "bf16"
    assert {t.dtype for t in hf_tensors(tmp_path / "bf16-out").values()} == {torch.bfloat16}
    import_hf(hf_dirs["llama untied"], tmp_path / "fp32", LayoutConfig(world_size=2), compute_dtype="bfloat16")
    result = runner.invoke(app, ["export", str(tmp_path / "fp32"), str(tmp_path / "fp32-out")])
    assert result.exit_code == 0 and "tensors (fp32) as a Hugging Face model directory" in result.output
    shapes = (("embedding.word_embeddings.weight", (8, 4)),)
    group = GroupSpec(0, False, "bfloat16", None, shapes)
    tensors = {kind: {"embedding.word_embeddings.weight": torch.ones(8, 4)} for kind in ("model", "main")}
    write_from_tensors(tmp_path / "gpt", LayoutConfig(world_size=1), [group], tensors, step=3)
    assert export(tmp_path / "gpt", tmp_path / "gpt-out").dtype == "bf16"


def test_export_megatron_format_keeps_the_consolidated_state_dict(hf_dirs, tmp_path):
    """--format megatron writes the checkpoint's own names and no config.json, as before."""
    import_hf(hf_dirs["llama tied sharded"], tmp_path / "ckpt", LayoutConfig(world_size=2))
    result = export(tmp_path / "ckpt", tmp_path / "out", "fp32", format="megatron")
    assert result.format == "megatron" and not (tmp_path / "out" / "config.json").exists()
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert list(index["weight_map"]) == read_index(tmp_path / "ckpt").order


def test_reshard_carries_the_model_record_and_inspect_shows_it(hf_dirs, tmp_path):
    import_hf(hf_dirs["qwen2 tied"], tmp_path / "ckpt", LayoutConfig(world_size=4, instances=2, outer="optim"))
    reshard(tmp_path / "ckpt", tmp_path / "re", LayoutConfig(world_size=3))
    assert read_index(tmp_path / "re").model == read_index(tmp_path / "ckpt").model
    assert inspect(tmp_path / "re")["model"]["config"]["model_type"] == "qwen2"
    text = runner.invoke(app, ["inspect", str(tmp_path / "re")])
    assert "Model: transformers qwen2, 2 layers, hidden 32, vocab 128" in text.output
    export(tmp_path / "re", tmp_path / "out", "fp32")
    assert torch.equal(hf_logits(tmp_path / "out"), hf_logits(hf_dirs["qwen2 tied"]))


# -- the model record ------------------------------------------------------------------------


def _write(path, record, layout=None):
    """A Toy checkpoint (see tests.support.ckpt_models) with `record` as its model record."""
    groups = synthetic_groups(False)
    shapes = {n: s for g in groups for n, s in g.members}
    main = {n: torch.randn(s) for n, s in shapes.items()}
    cfg = LayoutConfig(**(layout or {"world_size": 2}))
    return write_from_tensors(path, cfg, groups, {"model": main, "main": main}, model_record=record)


def test_an_index_without_a_record_stays_as_it_was(tmp_path):
    """The field is optional: left out of index.json when there is none, read back as None."""
    synthetic_checkpoint(tmp_path / "ckpt", {"world_size": 2})
    assert "model" not in json.loads((tmp_path / "ckpt" / "index.json").read_text())
    assert read_index(tmp_path / "ckpt").model is None and inspect(tmp_path / "ckpt")["model"] is None


def test_a_megatron_record_round_trips_through_the_index(tmp_path):
    record = {"format": "megatron-gpt", "config": GPTShape().record()}
    _write(tmp_path / "ckpt", record)
    assert read_index(tmp_path / "ckpt").model == record
    assert (
        "Model: megatron GPT (LayerNorm, GELU), 2 layers, hidden 64, vocab 128"
        in runner.invoke(app, ["inspect", str(tmp_path / "ckpt")]).output
    )


BAD_RECORDS = {
    "unknown format": ({"format": "onnx", "config": {}}, "model.format"),
    "config not an object": ({"format": "megatron-gpt", "config": [1, 2]}, "model.config"),
    "no model_type": ({"format": "transformers", "config": {"hidden_size": 8}}, "model_type"),
    "extra field": ({"format": "megatron-gpt", "config": {}, "weights": 1}, "weights"),
    "not JSON": ({"format": "transformers", "config": {"model_type": "llama", "dtype": torch.float32}}, "JSON"),
    "NaN": ({"format": "megatron-gpt", "config": {"eps": float("nan")}}, "not plain JSON"),
    "huge string": ({"format": "megatron-gpt", "config": {"name": "x" * 70_000}}, "characters"),
    "too many values": ({"format": "megatron-gpt", "config": {"ids": list(range(70_000))}}, "values"),
}


@pytest.mark.parametrize("case", list(BAD_RECORDS))
def test_a_bad_record_is_refused_before_anything_is_written(tmp_path, case):
    record, words = BAD_RECORDS[case]
    with pytest.raises(CheckpointError, match="model record") as err:
        _write(tmp_path / "ckpt", record)
    assert words in str(err.value) and not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("case", [c for c in BAD_RECORDS if c not in ("not JSON", "NaN")])
def test_a_bad_record_in_an_index_is_refused_by_every_reader(tmp_path, case):
    """An index edited to hold a bad record (and resealed) fails the schema, naming the field."""
    record, words = BAD_RECORDS[case]
    synthetic_checkpoint(tmp_path / "ckpt", {"world_size": 2})
    edit_index(tmp_path / "ckpt", lambda data: data.update(model=record))
    with pytest.raises(CheckpointError, match="is invalid") as err:
        read_index(tmp_path / "ckpt")
    assert words in str(err.value)


# -- the CLI, and every error as one paragraph -----------------------------------------------------


def test_cli_import_and_export(hf_dirs, tmp_path):
    """import --world-size 6 --instances 3 --outer optim, then export (auto: hf) --dtype fp32."""
    src, ckpt, out = hf_dirs["llama untied"], tmp_path / "ckpt", tmp_path / "out"
    args = ["--world-size", "6", "--instances", "3", "--outer", "optim", "--compute-dtype", "bf16"]
    result = runner.invoke(app, ["import", str(src), str(ckpt), *args])
    assert result.exit_code == 0, result.output
    assert "HFSDP 3x2" in result.output and "step 0, no optimizer state" in result.output
    assert read_index(ckpt).groups[0].dtype == "bfloat16"
    result = runner.invoke(app, ["export", str(ckpt), str(out), "--dtype", "fp32"])
    assert result.exit_code == 0, result.output
    assert "--format hf" in result.output
    assert torch.equal(hf_logits(out), hf_logits(src))


def test_cli_import_refuses_an_invalid_layout(hf_dirs, tmp_path):
    result = runner.invoke(
        app, ["import", str(hf_dirs["llama untied"]), str(tmp_path / "c"), "--world-size", "6", "--instances", "4"]
    )
    assert result.exit_code == 1 and "instances" in result.output and not (tmp_path / "c").exists()


def _drop(name):
    def edit(path: Path):
        tensors = load_file(path / "model.safetensors")
        del tensors[name]
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})

    return edit


def _add(name, shape):
    def edit(path: Path):
        tensors = load_file(path / "model.safetensors")
        tensors[name] = torch.zeros(shape)
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})

    return edit


def _edit_weight_map(edit):
    def apply(path: Path):
        file = path / "model.safetensors.index.json"
        data = json.loads(file.read_text())
        edit(data["weight_map"])
        file.write_text(json.dumps(data))

    return apply


def _set_config(**values):
    def edit(path: Path):
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, **values}))

    return edit


def _int8(path: Path):
    tensors = load_file(path / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(32, dtype=torch.int8)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _truncate(path: Path):
    file = path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:1000])


#: case -> (source model, how to break it, words the one paragraph must hold)
IMPORT_ERRORS = {
    "no config.json": ("llama untied", lambda p: (p / "config.json").unlink(), "config.json is missing"),
    "config.json not JSON": ("llama untied", lambda p: (p / "config.json").write_text("{NaN"), "config.json"),
    "config.json of an unknown model": (
        "llama untied",
        lambda p: (p / "config.json").write_text('{"model_type": "no-such-model"}'),
        "no-such-model",
    ),
    "a config declaring a billion layers": (
        "llama untied",
        _set_config(num_hidden_layers=10**9),
        "num_hidden_layers 1000000000 is above 1,024",
    ),
    "no weights": ("llama untied", lambda p: (p / "model.safetensors").unlink(), "no model.safetensors"),
    "a weight missing": ("llama untied", _drop("model.layers.1.mlp.up_proj.weight"), "'model.layers.1.mlp.up_proj"),
    "an extra weight": ("llama untied", _add("model.layers.0.extra.weight", (3, 3)), "'model.layers.0.extra.weight'"),
    "a wrong shape": ("llama untied", _add("model.norm.weight", (33,)), "shape [33]"),
    "quantized weights": ("llama untied", _int8, "floating point"),
    "a truncated file": ("llama untied", _truncate, "not a valid safetensors file"),
    "a name leaving the directory": (
        "llama tied sharded",
        _edit_weight_map(lambda m: m.update({"model.norm.weight": "../model-00001-of-00006.safetensors"})),
        "path separator",
    ),
    "a weight map that disagrees": (
        "llama tied sharded",
        _edit_weight_map(lambda m: m.update({"model.norm.weight": "model-00001-of-00006.safetensors"})),
        "disagree",
    ),
    "a listed file missing": (
        "llama tied sharded",
        lambda p: (p / "model-00002-of-00006.safetensors").unlink(),
        "model-00002-of-00006.safetensors, which",
    ),
}


@pytest.mark.parametrize("case", list(IMPORT_ERRORS))
def test_cli_import_errors_are_one_paragraph_exit_2_and_leave_nothing(hf_dirs, tmp_path, case):
    model, damage, words = IMPORT_ERRORS[case]
    src = tmp_path / "src"
    shutil.copytree(hf_dirs[model], src)
    damage(src)
    dst = tmp_path / "dst"
    result = runner.invoke(app, ["import", str(src), str(dst), "--world-size", "2"])
    assert result.exit_code == 2, result.output
    _one_paragraph(result.output, "hfsdp ckpt import: ", words)
    assert not dst.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["src"]


# -- mixture-of-experts families: experts saved one tensor per expert, held fused --------------------------

#: model_type -> what its config adds to TINY: 4 experts, 2 per token, on every layer
MOE = {
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 48,
        "head_dim": 8,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
}


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    """save_pretrained of each tiny MoE model, in shards: (directory, the model)."""
    from hfsdp.models.hf import build_causal_lm, config_from_dict

    root = tmp_path_factory.mktemp("moe")
    out = {}
    for model_type, extra in MOE.items():
        model = build_causal_lm(config_from_dict({"model_type": model_type, **TINY, **extra}), seed=5)
        model.save_pretrained(root / model_type, max_shard_size="20KB")
        out[model_type] = (root / model_type, model)
    return out


@pytest.mark.parametrize("model_type", list(MOE))
def test_experts_saved_one_per_expert_round_trip_through_the_fused_tensors(moe_dirs, tmp_path, model_type):
    """transformers 5 writes an MoE layer's experts one 2-D tensor per expert but its model holds them fused in
    3-D parameters. Imported (HFSDP 3x2) and exported, the files hold save_pretrained's tensors under its names,
    bit for bit; loaded back, every parameter and the logits equal the original model's, nothing missing."""
    src, original = moe_dirs[model_type]
    on_disk = hf_tensors(src)
    assert any(".experts.0." in name for name in on_disk)
    assert not any(name.endswith("experts.gate_up_proj") for name in on_disk)
    import_hf(src, tmp_path / "ckpt", LayoutConfig(**LAYOUTS["HFSDP 3x2 (world 6)"]))
    verify(tmp_path / "ckpt")
    export(tmp_path / "ckpt", tmp_path / "out", "fp32", max_shard_bytes=30_000)
    exported = hf_tensors(tmp_path / "out")
    assert set(exported) == set(on_disk)
    for name, tensor in on_disk.items():
        assert torch.equal(exported[name], tensor), name
    model, info = load_info(tmp_path / "out")
    assert info["missing_keys"] == info["unexpected_keys"] == set() and not info["mismatched_keys"]
    expected, loaded = original.state_dict(), model.state_dict()
    assert set(loaded) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name
    with torch.no_grad():
        assert torch.equal(model(input_ids=TOKENS).logits, original(input_ids=TOKENS).logits)


def test_an_expert_missing_from_the_files_is_refused_naming_the_fused_weight(moe_dirs, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(moe_dirs["mixtral"][0], src)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    name = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    file = src / index["weight_map"].pop(name)
    tensors = load_file(file)
    del tensors[name]
    save_file(tensors, file, metadata={"format": "pt"})
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    result = runner.invoke(app, ["import", str(src), str(tmp_path / "dst"), "--world-size", "2"])
    assert result.exit_code == 2, result.output
    _one_paragraph(result.output, "hfsdp ckpt import: ", "'model.layers.1.mlp.experts.gate_up_proj'")
    assert "one tensor per expert" in result.output
    assert not (tmp_path / "dst").exists()


def test_import_refuses_an_existing_destination_and_one_inside_the_source(hf_dirs, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(hf_dirs["llama untied"], src)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine.txt").write_text("keep")
    for dst, words in [(tmp_path / "taken", "already exists"), (src / "ckpt", "lies inside the source")]:
        result = runner.invoke(app, ["import", str(src), str(dst), "--world-size", "2"])
        assert result.exit_code == 2
        _one_paragraph(result.output, "hfsdp ckpt import: ", words)
    assert not (src / "ckpt").exists() and [p.name for p in (tmp_path / "taken").iterdir()] == ["mine.txt"]
    assert sorted(p.name for p in src.iterdir()) == sorted(p.name for p in hf_dirs["llama untied"].iterdir())


def test_export_hf_refuses_a_checkpoint_without_a_record(tmp_path):
    """--format hf needs the record and says to use --format megatron; the default then writes megatron."""
    synthetic_checkpoint(tmp_path / "ckpt", {"world_size": 2})
    result = runner.invoke(app, ["export", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--format", "hf"])
    assert result.exit_code == 2
    _one_paragraph(result.output, "hfsdp ckpt export: ", "--format megatron")
    assert not (tmp_path / "out").exists()
    result = runner.invoke(app, ["export", str(tmp_path / "ckpt"), str(tmp_path / "out")])
    assert result.exit_code == 0 and "--format megatron" in result.output


def test_export_hf_refuses_a_gpt_that_is_not_a_llama(tmp_path):
    """A megatron GPT with LayerNorm and GELU has no transformers twin: --format hf is refused, naming it; the
    default (auto) writes the megatron state dict and says why it is not hf; --format megatron works."""
    _write(tmp_path / "ckpt", {"format": "megatron-gpt", "config": GPTShape().record()})
    result = runner.invoke(app, ["export", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--format", "hf"])
    assert result.exit_code == 2
    _one_paragraph(result.output, "hfsdp ckpt export: ", "LayerNorm")
    assert "--format megatron" in result.output and not (tmp_path / "out").exists()
    result = runner.invoke(app, ["export", str(tmp_path / "ckpt"), str(tmp_path / "auto")])
    assert result.exit_code == 0, result.output
    assert "(--format megatron)" in result.output and "LayerNorm" in result.output
    assert not (tmp_path / "auto" / "config.json").exists()
    result = runner.invoke(app, ["export", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--format", "megatron"])
    assert result.exit_code == 0, result.output


def test_export_hf_refuses_a_record_that_does_not_match_the_weights(tmp_path):
    """A Llama record on a Toy model's weights (a wrong record passed at save) would not load: refused."""
    shape = GPTShape(normalization="RMSNorm", swiglu=True)
    for name, record in {
        "transformers": {"format": "transformers", "config": tiny_config().to_dict()},
        "megatron": {"format": "megatron-gpt", "config": shape.record()},
    }.items():
        _write(tmp_path / name, record)
        with pytest.raises(CheckpointError, match="does not hold the") as err:
            export(tmp_path / name, tmp_path / f"{name}-out", format="hf")
        assert "--format megatron" in str(err.value) and not (tmp_path / f"{name}-out").exists()


def test_export_refuses_a_record_declaring_more_layers_than_the_weights_hold(hf_dirs, tmp_path):
    """A (resealed) record claiming a billion layers is refused before transformers builds anything."""
    import_hf(hf_dirs["llama untied"], tmp_path / "ckpt", LayoutConfig(world_size=2))
    edit_index(tmp_path / "ckpt", lambda data: data["model"]["config"].update(num_hidden_layers=10**9))
    with pytest.raises(CheckpointError, match="declares 1000000000 decoder layers, but the weights hold tensors of 2"):
        export(tmp_path / "ckpt", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _one_paragraph(output: str, prefix: str, words: str) -> None:
    assert "Traceback" not in output
    text = output.strip()
    assert text.startswith(prefix) and "\n" not in text, output
    assert words in text, output


def test_import_follows_the_symlinks_of_the_hub_cache_but_refuses_a_fifo(hf_dirs, tmp_path):
    """The hub cache's snapshot files are symlinks into its blob store: imported. A FIFO would block a reader
    forever: refused before it is opened."""
    import os

    snapshot, blobs = tmp_path / "snapshots" / "abc", tmp_path / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for file in hf_dirs["llama tied sharded"].iterdir():
        shutil.copy(file, blobs / file.name)
        (snapshot / file.name).symlink_to(Path("../../blobs") / file.name)
    import_hf(snapshot, tmp_path / "ckpt", LayoutConfig(world_size=2))
    export(tmp_path / "ckpt", tmp_path / "out", "fp32")
    assert torch.equal(hf_logits(tmp_path / "out"), hf_logits(hf_dirs["llama tied sharded"]))

    fifo = tmp_path / "fifo"
    shutil.copytree(hf_dirs["llama untied"], fifo)
    (fifo / "model.safetensors").unlink()
    os.mkfifo(fifo / "model.safetensors")
    with pytest.raises(CheckpointError, match="not a regular file"):
        import_hf(fifo, tmp_path / "ckpt2", LayoutConfig(world_size=2))
    assert not (tmp_path / "ckpt2").exists()
