"""`validate-config` promises that a valid file trains: generated configs near the rules' boundaries go to both
`hfsdp validate-config` and a real one-step training run, which must agree.

Every config the validator accepts passes train's pre-launch checks and trains one step on 2 gloo ranks
through the training loop every rank of `hfsdp train` runs (`train_loop._train`), all of them in one spawned
group (a launch costs ~10 s; test_train.py launches the command itself). Every config it refuses is refused by
`hfsdp train --config` before any rank starts, with the same problems. The sample sits on the edges of what
megatron-core, the data and the trainer accept: head dimensions of 1 to 3 (rotary embeddings need an even
one), top-1 and top-k routing, one- and two-token vocabularies, query groups that do and do not divide,
sequences of one token.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

from typer.testing import CliRunner

from hfsdp.cli.checks.preflight import preflight
from hfsdp.cli.main import app
from hfsdp.cli.settings.train_config import build_file_config

from tests.support.distributed import run_distributed

runner = CliRunner()

#: Hand-picked edges: each is the smallest change that crosses a rule, next to its twin that does not.
EDGES = [
    {"model": {"hidden_size": 8, "num_attention_heads": 4}},  # head dim 2: trains
    {"model": {"hidden_size": 12, "num_attention_heads": 4}},  # head dim 3: rotary refuses it
    {"model": {"hidden_size": 8, "num_attention_heads": 8}},  # head dim 1
    {"model": {"num_moe_experts": 2, "moe_router_topk": 2}},  # top-2 of 2: trains
    {"model": {"num_moe_experts": 2, "moe_router_topk": 1}},  # megatron-core refuses top-1
    {"model": {"num_moe_experts": 2, "moe_router_topk": 3}},
    {"model": {"vocab_size": 2}},  # the smallest vocabulary the data can draw from
    {"model": {"vocab_size": 1}},
    {"model": {"seq_length": 1}},
    {"model": {"num_query_groups": 2}},
    {"model": {"num_query_groups": 3}},  # does not divide 4 heads
    {"model": {"normalization": "RMSNorm", "swiglu": True, "num_query_groups": 1}},
    {"ddp": {"num_distributed_optimizer_instances": 2, "outer_dp_sharding_strategy": "optim"}},
    {"parallel": {"expert_model_parallel_size": 2}, "model": {"num_moe_experts": 2}},
    {"train": {"global_batch_size": 2, "micro_batch_size": 1}},
    {"train": {"global_batch_size": 3, "micro_batch_size": 1}},  # does not split over 2 ranks
]
#: Values the random part combines, each around a boundary.
VALUES = {
    "model.hidden_size": [4, 6, 8, 12],
    "model.num_attention_heads": [1, 2, 3, 4],
    "model.num_query_groups": [1, 2],
    "model.num_moe_experts": [0, 2, 3],
    "model.moe_router_topk": [1, 2],
    "model.vocab_size": [1, 2, 5],
    "model.seq_length": [1, 2, 4],
    "model.normalization": ["LayerNorm", "RMSNorm"],
    "model.swiglu": [True, False],
    "train.micro_batch_size": [1, 2],
    "train.dtype": ["fp32", "bf16"],
    "train.recompute": [True, False],
}


def _configs() -> list[dict]:
    rng = random.Random(20)
    out = [{section: dict(body) for section, body in edge.items()} for edge in EDGES]
    for _ in range(8):
        data: dict = {}
        for key in rng.sample(sorted(VALUES), 5):
            section, name = key.split(".")
            data.setdefault(section, {})[name] = rng.choice(VALUES[key])
        out.append(data)
    for data in out:
        data.setdefault("parallel", {})["world_size"] = 2
        data.setdefault("model", {}).setdefault("num_layers", 1)
        data["model"].setdefault("hidden_size", 8)
        data["model"].setdefault("num_attention_heads", 2)
        data["model"].setdefault("vocab_size", 16)
        data["model"].setdefault("seq_length", 4)
        data.setdefault("train", {})["train_iters"] = 1
    return out


def _train_each(rank: int, world: int, paths: list[str]) -> list[str]:
    """One step of the training loop every rank of `hfsdp train` runs, per config, in this group; what happened."""
    import gc

    import torch

    from hfsdp.cli.rank.train_loop import _train
    from hfsdp.cli.settings.train_config import build_file_config

    outcomes = []
    for path in paths:
        try:
            summary = _train(build_file_config(path), torch.device("cpu"), rank)
            outcomes.append("trained" if math.isfinite(summary["final_loss"]) else f"loss {summary['final_loss']}")
        except Exception as err:  # what the rules missed: the test prints it
            outcomes.append(f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}")
        gc.collect()  # as run_training does: gloo's finished work in reference cycles
    return outcomes


def test_what_validate_config_accepts_trains_and_what_it_refuses_train_refuses(tmp_path):
    """validate-config's verdict on 24 generated configs is train's: every accepted one trains a step to a finite
    loss (2 ranks), every refused one is refused by `hfsdp train --config` before launch with the same problems."""
    accepted, refused = [], []
    for i, data in enumerate(_configs()):
        path = tmp_path / f"c{i}.json"
        path.write_text(json.dumps(data))
        verdict = runner.invoke(app, ["validate-config", str(path), "--format", "json"])
        report = json.loads(verdict.stdout)
        assert verdict.exit_code == (0 if report["valid"] else 1), verdict.stdout
        (accepted if report["valid"] else refused).append((str(path), report["errors"]))
    assert len(accepted) >= 10 and len(refused) >= 8, (len(accepted), len(refused))

    for path, errors in refused:
        result = runner.invoke(app, ["train", "--config", path])
        assert result.exit_code == 1 and "starting" not in result.output, result.output
        assert all(e["message"] in " ".join(result.output.split()) for e in errors), (result.output, errors)

    for path, _ in accepted:  # what train checks before launching passes too
        preflight(build_file_config(path), local_ranks=2)
    paths = [path for path, _ in accepted]
    outcomes = run_distributed(_train_each, 2, paths, timeout=300)[0]
    failed = {
        Path(p).name: (json.loads(Path(p).read_text()), o)
        for p, o in zip(paths, outcomes, strict=True)
        if o != "trained"
    }
    assert not failed, failed
