"""The Llama adapter of a megatron GPT (hfsdp.models.megatron.hf_adapter): pure functions, no megatron needed.

Its numerical check against megatron's own forward is in tests/ckpt/test_hf_distributed.py.
"""

from __future__ import annotations

import pytest
import torch

from hfsdp.models.megatron.gpt import GPTShape
from hfsdp.models.megatron.hf_adapter import UnmappableModel, from_hf, llama_config, llama_mapping, to_hf

LLAMA = dict(normalization="RMSNorm", swiglu=True, num_layers=2, hidden_size=32, vocab_size=64, ffn_hidden_size=48)


def record(**changes):
    return {**GPTShape(**LLAMA, num_attention_heads=4, num_query_groups=2).record(), **changes}


def random_state(mapping) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=gen) for name, shape in mapping.megatron_shapes().items()}


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (4, 1), (8, 2)], ids=["MHA", "GQA", "MQA", "GQA8"])
def test_round_trip_is_exact(heads, groups):
    """from_hf(to_hf(state dict)) is the state dict, bit for bit, for every grouping of query heads."""
    rec = GPTShape(**LLAMA, num_attention_heads=heads, num_query_groups=groups).record()
    mapping = llama_mapping(rec)
    state = random_state(mapping)
    hf = {hf_name: t for name, tensor in state.items() for hf_name, t in to_hf(rec, name, tensor)}
    assert len(hf) == 2 + 1 + 9 * 2  # embed, norm, head; q, k, v, o, gate, up, down and two norms per layer
    back = from_hf(rec, hf)
    assert list(back) == list(state)
    assert all(torch.equal(back[n], state[n]) for n in state)


def test_qkv_rows_follow_megatrons_per_group_layout():
    """linear_qkv holds, per query group, its q heads then one k and one v head; q_proj lists the q heads of every
    group in order, k_proj and v_proj one head per group."""
    mapping = llama_mapping(record())  # 4 heads, 2 groups, head_dim 8
    hd, hidden = 8, 32
    labels = []  # (kind, head) of every row block of megatron's QKV weight
    for g in range(2):
        labels += [("q", 2 * g), ("q", 2 * g + 1), ("k", g), ("v", g)]
    qkv = torch.cat([torch.full((hd, hidden), float(100 * "qkv".index(k) + h)) for k, h in labels])
    out = dict(mapping.to_hf("decoder.layers.1.self_attention.linear_qkv.weight", qkv))
    heads = {name.split(".")[-2]: t[::hd, 0].tolist() for name, t in out.items()}
    assert heads == {"q_proj": [0.0, 1.0, 2.0, 3.0], "k_proj": [100.0, 101.0], "v_proj": [200.0, 201.0]}
    assert set(out) == {f"model.layers.1.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj")}


def test_fc1_is_gate_then_up_and_renames_are_one_to_one():
    """SwiGLU's fc1 is [gate; up]; every other tensor keeps its values under its Llama name."""
    mapping = llama_mapping(record())
    fc1 = torch.arange(96 * 32, dtype=torch.float32).view(96, 32)
    out = dict(mapping.to_hf("decoder.layers.0.mlp.linear_fc1.weight", fc1))
    assert torch.equal(out["model.layers.0.mlp.gate_proj.weight"], fc1[:48])
    assert torch.equal(out["model.layers.0.mlp.up_proj.weight"], fc1[48:])
    renames = {
        "embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "decoder.layers.0.input_layernorm.weight": "model.layers.0.input_layernorm.weight",
        "decoder.layers.0.self_attention.linear_proj.weight": "model.layers.0.self_attn.o_proj.weight",
        "decoder.layers.0.pre_mlp_layernorm.weight": "model.layers.0.post_attention_layernorm.weight",
        "decoder.layers.0.mlp.linear_fc2.weight": "model.layers.0.mlp.down_proj.weight",
        "decoder.final_layernorm.weight": "model.norm.weight",
        "output_layer.weight": "lm_head.weight",
    }
    for name, hf_name in renames.items():
        tensor = torch.randn(mapping.megatron_shapes()[name])
        [(got_name, got)] = mapping.to_hf(name, tensor)
        assert got_name == hf_name and torch.equal(got, tensor)


def test_flat_ranges_are_the_rows_of_the_row_major_tensor():
    """An exporter streams a part as flat ranges; they select exactly the part's rows."""
    mapping = llama_mapping(record())
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    qkv = torch.randn(mapping.megatron_shapes()[name])
    flat = qkv.reshape(-1)
    for part, (hf_name, tensor) in zip(mapping.parts(name), mapping.to_hf(name, qkv), strict=True):
        assert part.hf_name == hf_name
        joined = torch.cat([flat[a:b] for a, b in part.flat_ranges(qkv.shape[1])])
        assert torch.equal(joined.view(part.shape), tensor)


def test_llama_config_takes_the_record_as_it_is():
    """Heads, query groups, sizes, RMSNorm epsilon and RoPE base come from the record; embeddings are untied."""
    config = llama_config(record(layernorm_epsilon=1e-6, rotary_base=500000))
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 8)
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (32, 48, 2)
    assert config["rms_norm_eps"] == 1e-6 and config["rope_theta"] == 500000.0
    assert config["tie_word_embeddings"] is False and config["hidden_act"] == "silu"
    assert config["vocab_size"] == 64 and config["max_position_embeddings"] == 32


REFUSED = {
    "LayerNorm": (record(normalization="LayerNorm"), "LayerNorm"),
    "GELU": (record(swiglu=False), "GELU"),
    "biases": (record(add_bias_linear=True), "biases"),
    "MoE": (record(num_moe_experts=4), "mixture-of-experts"),
    "tied": (record(share_embeddings_and_output_weights=True), "tied"),
    "learned positions": (record(position_embedding_type="learned_absolute"), "learned_absolute"),
    "no heads": (record(num_attention_heads=None), "num_attention_heads"),
    "heads not divisible": (record(num_query_groups=3), "do not divide"),
    "no record": ({}, "normalization"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_gpt_that_is_not_a_llama_is_refused_naming_the_feature(case):
    """Anything Llama lacks is refused in one paragraph that names it and suggests --format megatron."""
    rec, feature = REFUSED[case]
    with pytest.raises(UnmappableModel) as err:
        llama_mapping(rec)
    message = str(err.value)
    assert feature in message and "--format megatron" in message and "\n" not in message
