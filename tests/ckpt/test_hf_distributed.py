"""Hugging Face in and out with real models: sharded loads of imports, online saves exported, megatron's Llama.

- imported checkpoints (several source layouts) load into transformers models
  sharded on 4 gloo ranks with other layouts, whose forward gives the original
  model's logits; loading them with an optimizer is refused (no optimizer state);
- a transformers Llama sharded with `fully_shard`, trained a few AdamW steps and
  saved online with its model record, exports to a directory whose
  `from_pretrained` logits are the sharded model's own, and whose groups are
  exactly the ones an import of that model writes;
- a Llama-style megatron GPT written with its record exports to a transformers
  Llama with megatron's logits (fp32, rtol 1e-5): the adapter's QKV and SwiGLU
  mapping checked numerically.

All cases of a world size run in one spawned process group (spawning costs seconds).
"""

from __future__ import annotations

import pytest
import torch

from hfsdp.ckpt import export, import_hf, read_index, resolve
from hfsdp.core.rules.config import LayoutConfig

from tests.support.distributed import run_distributed
from tests.support.hf_dirs import LAYOUTS, MODELS, TOKENS, hf_logits, load_info, tiny_config, write_hf_dir

#: case -> (model of tests.support.hf_dirs.MODELS, layout it is imported with, layout of the 4 ranks that load it)
LOAD_CASES = {
    "tied, 3x2 (world 6) into HFSDP 2x2": (
        "llama tied sharded",
        "HFSDP 3x2 (world 6)",
        dict(instances=2, outer="optim"),
    ),
    "untied, same layout": ("llama untied", "HFSDP 2x2", dict(instances=2, outer="optim")),
    "bf16 files, one rank into ZeRO-3 1x4": ("llama bf16 sharded", "one rank", dict()),
    "qwen2, ZeRO-1 1x3 into HSDP 2x2": ("qwen2 tied", "ZeRO-1 1x3", dict(instances=2)),
}
ONLINE = dict(instances=2, outer="optim")
STEPS = 3


def _sharded(config, layout: dict, seed: int):
    from hfsdp.core import fully_shard
    from hfsdp.core.engine.mesh import build_meshes
    from hfsdp.models.hf import build_causal_lm, decoder_layers

    cfg = LayoutConfig(world_size=torch.distributed.get_world_size(), **layout)
    model = build_causal_lm(config, seed=seed)
    return fully_shard(model, cfg, build_meshes(cfg, "cpu"), units=decoder_layers(model))


def _forward(sharded) -> torch.Tensor:
    with torch.no_grad():
        return sharded(input_ids=TOKENS, use_cache=False).logits


def _load_cases(rank, world, cases, online_root, online_tied):
    """Every import loaded into a sharded model; then the online save of a trained one."""
    from hfsdp.ckpt import CheckpointError, load_checkpoint, save_checkpoint
    from hfsdp.models.hf import causal_lm_loss, load_config

    out = {}
    for name, (hf_dir, ckpt, layout) in cases.items():
        sharded = _sharded(load_config(hf_dir), layout, seed=123)  # other weights than the files' until loaded
        extra = load_checkpoint(ckpt, sharded)
        refused = None
        try:
            load_checkpoint(ckpt, sharded, torch.optim.AdamW(sharded.parameters()))
        except CheckpointError as err:
            refused = str(err)
        out[name] = {"logits": _forward(sharded), "extra": extra, "refused": refused}

    sharded = _sharded(tiny_config(tied=online_tied), ONLINE, seed=5)
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(STEPS):
        tokens = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(100 * step + rank))
        causal_lm_loss(sharded, tokens[:, :-1], tokens[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    record = {"format": "transformers", "config": sharded.config.to_dict()}
    save_checkpoint(online_root, sharded, opt, step=STEPS, model_record=record)
    out["online"] = _forward(sharded)
    return out


@pytest.fixture(scope="module")
def distributed_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-dist")
    dirs, cases = {}, {}
    for name, (model, source_layout, target) in LOAD_CASES.items():
        if model not in dirs:
            model_type, tied, dtype, shard = MODELS[model]
            dirs[model] = write_hf_dir(root / f"hf-{len(dirs)}", model_type, tied, dtype, shard, seed=len(dirs))
        ckpt = root / f"ckpt-{len(cases)}"
        import_hf(dirs[model], ckpt, LayoutConfig(**LAYOUTS[source_layout]))
        cases[name] = (dirs[model], ckpt, target)
    results = run_distributed(_load_cases, 4, cases, root / "online", True)
    return root, dirs, results


@pytest.mark.parametrize("case", list(LOAD_CASES))
def test_an_import_loads_into_a_sharded_model_with_the_original_logits(distributed_run, case):
    """Imported at one layout, loaded at another on 4 ranks: the sharded forward is the original model's."""
    _, dirs, results = distributed_run
    expected = hf_logits(dirs[LOAD_CASES[case][0]])
    for result in results:
        torch.testing.assert_close(result[case]["logits"], expected, rtol=1e-5, atol=1e-6)
        assert result[case]["extra"] == {"step": 0}


def test_loading_an_import_with_an_optimizer_is_refused(distributed_run):
    """An import holds no optimizer state: load it with optimizer=None and start the optimizer fresh."""
    _, _, results = distributed_run
    for result in results:
        for case in LOAD_CASES:
            assert "holds no optimizer state" in result[case]["refused"]


def test_an_online_save_exports_to_what_the_sharded_model_computes(distributed_run, tmp_path):
    """A tied Llama trained 3 AdamW steps on HFSDP 2x2 and saved with its record: export --format hf gives
    transformers logits equal to the sharded model's forward."""
    root, _, results = distributed_run
    out = tmp_path / "out"
    assert export(root / "online", out, "fp32").format == "hf"
    _, info = load_info(out)
    assert info["missing_keys"] == info["unexpected_keys"] == set()
    expected = hf_logits(out)
    for result in results:
        torch.testing.assert_close(result["online"], expected, rtol=1e-5, atol=1e-6)


def test_an_online_save_has_the_groups_an_import_writes(distributed_run, tmp_path):
    """The import derives groups, order and unsharded tensors exactly as fully_shard and the online save do
    (the tied head once, under its first name)."""
    root, _, _ = distributed_run
    write_hf_dir(tmp_path / "hf", tied=True)
    import_hf(tmp_path / "hf", tmp_path / "ckpt", LayoutConfig(world_size=4, **ONLINE))
    saved, imported = read_index(resolve(root / "online")), read_index(tmp_path / "ckpt")
    assert saved.groups == imported.groups and saved.order == imported.order
    assert saved.unsharded == imported.unsharded == {}
    assert {n: t.pieces for n, t in saved.tensors["main"].items()} == {
        n: t.pieces for n, t in imported.tensors["main"].items()
    }
    assert saved.model["format"] == "transformers" and saved.model["config"]["tie_word_embeddings"] is True


# -- a Llama-style megatron GPT ----------------------------------------------------------------------

GPT = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=128,
    seq_length=16,
    ffn_hidden_size=48,
    normalization="RMSNorm",
    swiglu=True,
)
GPT_TOKENS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))


def _megatron_gpt(rank, world, path):
    """Build the GPT, write it as a checkpoint (HFSDP 2x2) with its record; return megatron's logits."""
    from hfsdp.ckpt import GroupSpec, write_from_tensors
    from hfsdp.models.megatron.adapter import initialize_parallel
    from hfsdp.models.megatron.cpu_shim import seed_megatron
    from hfsdp.models.megatron.gpt import GPTShape, build_gpt, reinit_by_global_name

    shape = GPTShape(**GPT)
    initialize_parallel(LayoutConfig(world_size=1))
    seed_megatron(0)
    model = build_gpt(shape)
    reinit_by_global_name(model, None, seed=3, std=0.1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight"):
                param.uniform_(0.5, 1.5)
    params = {name: param.detach().clone() for name, param in model.named_parameters()}
    groups = [
        GroupSpec(
            i,
            False,
            "float32",
            None,
            tuple((f"decoder.layers.{i}.{n}", tuple(p.shape)) for n, p in layer.named_parameters()),
        )
        for i, layer in enumerate(model.decoder.layers)
    ]
    in_units = {n for g in groups for n, _ in g.members}
    root = tuple((n, tuple(p.shape)) for n, p in params.items() if n not in in_units)
    groups.append(GroupSpec(len(groups), False, "float32", None, root))
    record = {"format": "megatron-gpt", "config": shape.record()}
    cfg = LayoutConfig(world_size=4, instances=2, outer="optim")
    write_from_tensors(path, cfg, groups, {"model": params, "main": params}, order=list(params), model_record=record)
    seq = GPT_TOKENS.shape[1]
    positions = torch.arange(seq).expand_as(GPT_TOKENS)
    causal = torch.ones(seq, seq, dtype=torch.bool).triu(1)[None, None]
    model.eval()
    with torch.no_grad():
        logits = model(GPT_TOKENS, positions, causal)
    return {"logits": logits, "shapes": [(n, tuple(p.shape)) for n, p in params.items()]}


def test_a_llama_style_megatron_gpt_exports_to_a_transformers_llama_with_its_logits(tmp_path):
    """megatron GPT (RMSNorm, SwiGLU, GQA 4 heads / 2 groups) -> checkpoint -> export --format hf -> transformers:
    the same logits (fp32, rtol 1e-5), nothing missing or unexpected; the adapter lists exactly the GPT's tensors."""
    from transformers import AutoModelForCausalLM

    from hfsdp.models.megatron.gpt import GPTShape
    from hfsdp.models.megatron.hf_adapter import llama_mapping

    [result] = run_distributed(_megatron_gpt, 1, tmp_path / "ckpt")
    assert result["shapes"] == list(llama_mapping(GPTShape(**GPT).record()).megatron_shapes().items())
    assert export(tmp_path / "ckpt", tmp_path / "out", "fp32", max_shard_bytes=40_000).format == "hf"
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert info["missing_keys"] == info["unexpected_keys"] == set() and not info["mismatched_keys"]
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_key_value_heads == 2
    with torch.no_grad():
        logits = model(input_ids=GPT_TOKENS).logits
    assert logits.abs().max() > 0.1  # weights large enough that a wrong mapping would show
    torch.testing.assert_close(logits, result["logits"], rtol=1e-5, atol=1e-5)
