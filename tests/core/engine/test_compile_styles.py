"""Every way a user compiles a unit trains the same weights, and none puts hfsdp's work inside a compiled graph.

The engine's work around a unit (the gather into its storage, the casts, the side-stream events, the storage
resizes) must stay eager: traced into a graph, the compiler may reorder it, which on a GPU trained wrong,
non-deterministic weights. Each style here compiles with a recording backend (no code generation) that keeps
every graph TorchDynamo hands it, so a test can read what was traced. One spawned group of 2 ranks (ZeRO-3 1x2,
bf16 compute) runs every case, eager and `module.compile()` also with FusedAdamW keeping the masters as the bf16
weights plus remainders; `bench/gpu_correctness.py` checks the same styles on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.distributed import run_distributed

STEPS = 3
#: Graph ops that are hfsdp's work and must never be traced: storage resizes, the side streams' events.
ENGINE_OPS = ("resize_storage_bytes_", "record_event", "wait_event", "wait_stream", "set_stream")
STYLES = (
    "eager",
    "module.compile()",
    "module.compile(fullgraph=True)",
    "module.compile() after fully_shard",
    "forward = torch.compile(forward)",
    "torch.compile(module) in the model",
    "model.compile()",
)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return LlamaForCausalLM(config)


def _train(rank, world, style: str, graphs: list, remainders: bool = False):
    import torch.distributed as dist

    from hfsdp.core import LayoutConfig, MixedPrecision, build_meshes, fully_shard
    from hfsdp.core.buffers.main_params import piece_of

    def backend(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    torch._dynamo.reset()
    model = _llama()
    layers = model.model.layers
    if style == "module.compile()":
        for layer in layers:
            layer.compile(backend=backend)
    elif style == "module.compile(fullgraph=True)":
        for layer in layers:
            layer.compile(backend=backend, fullgraph=True)
    elif style == "forward = torch.compile(forward)":
        for layer in layers:
            layer.forward = torch.compile(layer.forward, backend=backend)
    elif style == "torch.compile(module) in the model":
        for i in range(len(layers)):
            layers[i] = torch.compile(layers[i], backend=backend, fullgraph=True)
    cfg = LayoutConfig(world_size=world)
    mp = MixedPrecision(param_dtype=torch.bfloat16)
    sharded = fully_shard(model, cfg, build_meshes(cfg, "cpu"), units=model.model.layers, mp=mp)
    if style == "module.compile() after fully_shard":
        for layer in model.model.layers:
            layer.compile(backend=backend, fullgraph=True)
    elif style == "model.compile()":
        sharded.compile(backend=backend)
    if remainders:  # the masters as the bf16 weights the units compute with plus 16-bit remainders
        from hfsdp.core import FusedAdamW

        opt = FusedAdamW(sharded.parameters(), lr=1e-2, backend="torch", store_param_remainders=True)
    else:
        opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    initial = [p.detach().clone() for p in sharded.parameters()]
    gen = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(STEPS):
        tokens = torch.randint(0, 128, (2 * world, 16), generator=gen)[2 * rank : 2 * rank + 2]
        logits = sharded(input_ids=tokens, use_cache=False).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 128), tokens.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    names = sorted(sharded.state_dict())  # collective; the keys land on rank 0
    pieces = [piece_of(p).master().clone() for p in sharded.parameters()]  # the fp32 masters
    modules = [type(m).__name__ for m in layers]
    return {"losses": losses, "names": names, "initial": initial, "pieces": pieces, "modules": modules}


def _refusals(rank, world):
    from hfsdp.core import LayoutConfig, build_meshes, fully_shard

    out = {}
    cfg = LayoutConfig(world_size=world)
    try:
        fully_shard(torch.compile(_llama()), cfg, build_meshes(cfg, "cpu"), units=[])
    except ValueError as err:
        out["root wrapper"] = str(err)
    model = _llama()
    sharded = fully_shard(model, cfg, build_meshes(cfg, "cpu"), units=model.model.layers)
    model.model.layers[1] = torch.compile(model.model.layers[1])
    try:
        sharded(input_ids=torch.zeros(1, 4, dtype=torch.long))
    except RuntimeError as err:
        out["replaced after sharding"] = str(err)
    return out


def _cases(rank, world):
    out = {}
    for style in STYLES:
        graphs: list[str] = []
        out[style] = _train(rank, world, style, graphs)
        out[style]["graphs"] = graphs
    for style in REMAINDER_STYLES:
        out[style, "remainders"] = _train(rank, world, style, [], remainders=True)
    out["refusals"] = _refusals(rank, world)
    return out


#: Styles also run with FusedAdamW(store_param_remainders=True): the units compute with the kept bf16 shard's views.
REMAINDER_STYLES = ("eager", "module.compile()")


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_cases, 2)


#: Styles that compile the units alone: the recording backend runs their graphs op for op, so they must give the
#: eager run's bits. Compiling the whole model also compiles transformers' own mask building, which then passes an
#: explicit causal mask to attention instead of `is_causal` (another SDPA path, rounded differently).
UNIT_STYLES = STYLES[1:-1]


@pytest.mark.parametrize("style", UNIT_STYLES)
def test_each_compile_style_trains_the_eager_weights(runs, style):
    """Every way of compiling the units gives the eager run's losses and weights bit for bit (any difference would
    be the engine's work reordered or lost), under the model's own names."""
    for rank_runs in runs:
        eager, compiled = rank_runs["eager"], rank_runs[style]
        assert compiled["losses"] == eager["losses"]
        for got, want in zip(compiled["pieces"], eager["pieces"], strict=True):
            assert torch.equal(got, want)
    assert runs[0][style]["names"] == runs[0]["eager"]["names"]
    assert not any("_orig_mod" in n for n in runs[0][style]["names"])


def test_compiled_units_train_the_eager_weights_with_remainders(runs):
    """With the masters kept as bf16 weights plus remainders, compiled units give the eager run's losses and
    masters bit for bit too."""
    for rank_runs in runs:
        eager, compiled = rank_runs["eager", "remainders"], rank_runs["module.compile()", "remainders"]
        assert compiled["losses"] == eager["losses"]
        for got, want in zip(compiled["pieces"], eager["pieces"], strict=True):
            assert torch.equal(got, want)


def test_a_compiled_model_trains_the_eager_losses(runs):
    """`model.compile()` around the sharded model: the eager losses to bf16 rounding (its attention takes another
    path, see UNIT_STYLES), the model's names."""
    eager, compiled = runs[0]["eager"], runs[0]["model.compile()"]
    torch.testing.assert_close(torch.tensor(compiled["losses"]), torch.tensor(eager["losses"]), rtol=1e-4, atol=0)
    assert compiled["names"] == eager["names"]


#: How far `model.compile()`'s weights may be from the eager ones, as a share of the eager update (3 AdamW steps of
#: lr 1e-2 on tiny gradients: its other attention path's rounding moves them by up to 6%).
WHOLE_MODEL_SHARE = 0.15


@pytest.mark.parametrize("style", STYLES[1:])
def test_no_engine_work_is_traced_into_a_graph(runs, style):
    """TorchDynamo traced the model's own ops (graphs exist) and none of hfsdp's: no storage resize, no stream or
    event op, no read of a main weight; and the compiled run trained the eager weights on every rank (bit for bit
    when the units are compiled, within 15% of the update with `model.compile()`), which moved from the initial."""
    graphs = runs[0][style]["graphs"]
    assert graphs, f"{style}: nothing was compiled"
    for graph in graphs:
        for op in ENGINE_OPS:
            assert op not in graph, f"{style}: {op} was traced into a graph"
        assert "_main" not in graph and "unsharded" not in graph
    for rank, rank_runs in enumerate(runs):
        eager, compiled = rank_runs["eager"], rank_runs[style]
        pieces = zip(compiled["pieces"], eager["pieces"], eager["initial"], strict=True)
        for index, (got, want, initial) in enumerate(pieces):
            where = f"{style}: rank {rank}, parameter {index}"
            if style in UNIT_STYLES:
                assert torch.equal(got, want), where
            else:
                assert (got - want).norm() <= WHOLE_MODEL_SHARE * (want - initial).norm(), where
            assert got.numel() == 0 or not torch.equal(got, initial), f"{where}: not trained"


def test_a_wrapper_in_the_model_is_compiled_in_place(runs):
    """`torch.compile(layer)` put into the model before fully_shard is replaced by the layer itself, compiled in
    place: the model holds its own modules again (as hfsdp's unit classes), so names and checkpoints are the
    model's."""
    assert runs[0]["torch.compile(module) in the model"]["modules"] == ["HFSDPUnitLlamaDecoderLayer"] * 2


def test_what_cannot_keep_the_names_is_refused_with_the_way_that_does(runs):
    """A compiled root handed to fully_shard, and a unit replaced by `torch.compile(unit)` after sharding, are each
    refused with one message naming module.compile()."""
    refusals = runs[0]["refusals"]
    assert "fully_shard on the model itself" in refusals["root wrapper"]
    assert "model.compile()" in refusals["root wrapper"]
    message = refusals["replaced after sharding"]
    assert "model.layers.1" in message and "after fully_shard" in message and "module.compile()" in message
    assert "\n" not in message
