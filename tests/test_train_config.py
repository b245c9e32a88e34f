"""`hfsdp train`'s configuration: flag > file > default, and every invalid setting named by its flag."""

from __future__ import annotations

import pytest

from hfsdp.cli.train_config import build_train_config
from hfsdp.core.config import ConfigError


def _build(flags=None, world=4, cuda=False):
    return build_train_config(flags or {}, world_size=world, nproc=world, cuda_available=cuda)


def _fields(err: ConfigError) -> set[str]:
    return {p.field for p in err.problems}


def test_defaults_train_zero3_on_one_instance():
    """With no flags the run is ZeRO-3 over 4 ranks, 16 sequences per step in 2 microbatches."""
    cfg = _build()
    assert cfg.layout.layout_name.startswith("ZeRO-3 1x4")
    assert cfg.num_microbatches == 2 and cfg.steps == 20


def test_flags_override_the_config_file(tmp_path):
    """A config file sets the layout and model; a flag given on the command line wins over it."""
    path = tmp_path / "run.yaml"
    path.write_text(
        "parallel: {world_size: 8}\n"
        "ddp: {outer_dp_sharding_strategy: optim, num_distributed_optimizer_instances: 2}\n"
        "model: {hidden_size: 48, num_attention_heads: 4}\n"
        "train: {global_batch_size: 8, micro_batch_size: 1, train_iters: 7}\n"
    )
    cfg = _build({"config": str(path), "steps": 3})
    assert cfg.layout.world_size == 4  # the launcher's world size, not the file's
    assert cfg.layout.layout_name.startswith("HFSDP 2x2")
    assert (cfg.hidden, cfg.steps, cfg.layout.global_batch_size) == (48, 3, 8)


def test_invalid_settings_are_all_reported_by_flag(tmp_path):
    """Bad values are reported together, each under its flag, before anything starts."""
    with pytest.raises(ConfigError) as err:
        _build(
            {
                "outer": "optim",
                "hidden": 30,
                "heads": 4,
                "dtype": "fp16",
                "data_path": str(tmp_path / "missing"),
                "save_every": 5,
                "device": "cuda",
                "load": str(tmp_path / "no-checkpoint"),
            }
        )
    expected = {"--outer", "--hidden", "--dtype", "--data-path", "--save-every", "--device", "--load"}
    assert expected <= _fields(err.value)


def test_batch_sizes_must_split_over_ranks():
    """A global batch that does not split into micro_batch_size x dp is rejected under --global-batch-size."""
    with pytest.raises(ConfigError) as err:
        _build({"global_batch_size": 10, "micro_batch_size": 2})
    assert "--global-batch-size" in _fields(err.value)


def test_moe_topk_cannot_exceed_experts():
    """Routing to more experts than exist is rejected under --moe-topk."""
    with pytest.raises(ConfigError) as err:
        _build({"num_moe_experts": 2, "moe_topk": 3})
    assert _fields(err.value) == {"--moe-topk"}
