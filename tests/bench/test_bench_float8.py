"""bench_step's torchao float8 rows without a GPU and without torchao: the engine names, the refusals (torchao
missing, the megatron-core GPT), which Linear layers are converted (a tiny model and a stand-in for torchao), the
recipe's config, the scale precompute after the step, the raised recompile limit, and the looser loss check of an
fp8 row. One test converts with the real torchao where it is installed."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import _float8  # noqa: E402
import _loss_check  # noqa: E402
import _step_model  # noqa: E402
import bench_step  # noqa: E402
from _engine_base import engine_family  # noqa: E402


class Unit(nn.Module):
    """A transformer layer's Linear layers: two the fp8 kernels take, one whose output dim (24) they do not."""

    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(32, 32, bias=False)
        self.odd = nn.Linear(32, 24, bias=False)
        self.mlp = nn.Sequential(nn.Linear(32, 64, bias=False), nn.SiLU(), nn.Linear(64, 32, bias=False))

    def forward(self, x):
        return x + self.mlp(self.q_proj(x)) + self.odd(x).sum(-1, keepdim=True)


class TinyLM(nn.Module):
    """A causal LM's shape: embeddings, units, and an output layer whose dims are fp8-shaped (32 -> 64)."""

    def __init__(self, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.layers = nn.ModuleList(Unit() for _ in range(layers))
        self.lm_head = nn.Linear(32, 64, bias=False)


class FakeConfig:
    """Records how it was made, as torchao's Float8LinearConfig would be."""

    def __init__(self, enable_fsdp_float8_all_gather=False, recipe=None):
        self.enable_fsdp_float8_all_gather, self.recipe = enable_fsdp_float8_all_gather, recipe

    @classmethod
    def from_recipe_name(cls, name):
        return cls(recipe=name)


def fake_torchao():
    """A stand-in for `torchao.float8`: its convert asks the filter about every nn.Linear, by FQN, as torchao's
    swap_linear_layers does, and records the ones chosen."""
    chosen: list[str] = []

    def convert_to_float8_training(module, *, module_filter_fn=None, config=None):
        for fqn, mod in module.named_modules():
            if isinstance(mod, nn.Linear) and module_filter_fn(mod, fqn):
                chosen.append(fqn)
        fake.config = config
        return module

    fake = SimpleNamespace(
        Float8LinearConfig=FakeConfig,
        convert_to_float8_training=convert_to_float8_training,
        precompute_float8_dynamic_scale_for_fsdp=lambda model: None,
        chosen=chosen,
    )
    return fake


@pytest.mark.parametrize(
    ("name", "recipe"),
    [
        ("fsdp2+float8t", "tensorwise"),
        ("fsdp2+float8r", "rowwise"),
        ("model+float8t", "tensorwise"),
        ("model+float8r", "rowwise"),
        ("fsdp2", None),
        ("model", None),
        ("hfsdp+float8t", None),
        ("plain+float8t", None),
        ("fsdp2+float8", None),
        ("fsdp2+float8t+keep", None),
    ],
)
def test_float8_engine_names(name, recipe):
    assert _float8.float8_recipe(name) == recipe


def test_engine_family_is_the_name_before_the_first_plus():
    assert engine_family("fsdp2+float8t") == "fsdp2"
    assert engine_family("model+float8r") == "model"
    assert engine_family("hfsdp+fused+clip") == "hfsdp"
    assert engine_family("mfsdp2") == "mfsdp2"


def test_the_suffix_of_each_recipe_round_trips():
    for suffix, recipe in _float8.FLOAT8_RECIPES.items():
        assert _float8.float8_suffix(recipe) == suffix


def _without_torchao(monkeypatch):
    """`import torchao.float8` raises ImportError, whether or not torchao is installed here."""
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)


def test_a_missing_torchao_is_refused_in_one_line(monkeypatch):
    _without_torchao(monkeypatch)
    with pytest.raises(_float8.Float8Unavailable) as err:
        _float8.require_torchao()
    assert "torchao" in str(err.value)
    assert "\n" not in str(err.value)


def test_the_bench_refuses_a_float8_engine_without_torchao(monkeypatch, capsys):
    _without_torchao(monkeypatch)
    with pytest.raises(SystemExit) as err:
        bench_step.parse_args(["--model", "llama", "--engines", "fsdp2,fsdp2+float8t"])
    assert err.value.code == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert "fsdp2+float8t" in message and "torchao" in message


def test_the_bench_without_float8_engines_never_imports_torchao(monkeypatch):
    _without_torchao(monkeypatch)
    args = bench_step.parse_args(["--model", "llama", "--engines", "hfsdp,fsdp2,model"])
    assert args.engines == ["hfsdp", "fsdp2", "model"]


def test_the_bench_accepts_the_float8_engines_where_torchao_imports(monkeypatch):
    monkeypatch.setattr(bench_step, "require_torchao", fake_torchao)
    names = "fsdp2,fsdp2+float8t,fsdp2+float8r,model,model+float8t,model+float8r"
    args = bench_step.parse_args(["--model", "llama", "--engines", names])
    assert args.engines == names.split(",")


def test_the_bench_refuses_float8_for_the_megatron_gpt(monkeypatch, capsys):
    monkeypatch.setattr(bench_step, "require_torchao", fake_torchao)
    with pytest.raises(SystemExit):
        bench_step.parse_args(["--model", "gpt", "--engines", "fsdp2+float8r"])
    assert "--model llama" in capsys.readouterr().err


def test_an_unknown_float8_name_is_refused(capsys):
    with pytest.raises(SystemExit):
        bench_step.parse_args(["--engines", "fsdp2+float8x"])
    assert "fsdp2+float8t" in capsys.readouterr().err  # the message lists the names there are


def test_only_the_units_fp8_shaped_linears_are_converted():
    model, fake = TinyLM(), fake_torchao()
    label = _float8.convert(model, list(model.layers), "tensorwise", fsdp_all_gather=True, float8=fake)
    expected = [f"layers.{i}.{name}" for i in range(2) for name in ("q_proj", "mlp.0", "mlp.2")]
    assert sorted(fake.chosen) == sorted(expected)  # not `odd` (24 columns), not the output layer
    assert "6 unit Linears" in label and "2 left in the compute dtype" in label and "fp8 all-gather" in label


def test_the_filter_is_by_identity_not_by_name():
    """A Linear outside the units is left alone even when its name looks like a unit's."""
    model, fake = TinyLM(layers=1), fake_torchao()
    model.extra = nn.ModuleDict({"q_proj": nn.Linear(32, 32)})
    _float8.convert(model, list(model.layers), "rowwise", fsdp_all_gather=False, float8=fake)
    assert "extra.q_proj" not in fake.chosen and "layers.0.q_proj" in fake.chosen


def test_a_model_with_nothing_to_convert_is_refused():
    units = [nn.Sequential(nn.Linear(24, 24))]
    with pytest.raises(ValueError, match="convert nothing"):
        _float8.convert(nn.Sequential(*units), units, "tensorwise", fsdp_all_gather=True, float8=fake_torchao())


@pytest.mark.parametrize(
    ("recipe", "fsdp", "gather", "from_recipe"),
    [
        ("tensorwise", True, True, None),  # torchtitan's tensorwise: fp8 all-gather under FSDP2
        ("tensorwise", False, False, None),  # the model alone gathers nothing
        ("rowwise", True, False, "rowwise"),  # torchao gathers rowwise weights in the compute dtype
    ],
)
def test_the_recipe_config(recipe, fsdp, gather, from_recipe):
    config = _float8.float8_config(fake_torchao(), recipe, fsdp)
    assert config.enable_fsdp_float8_all_gather is gather
    assert config.recipe == from_recipe


def test_the_scales_are_precomputed_only_where_weights_are_gathered_in_fp8():
    fake = fake_torchao()
    assert _float8.precompute_scales(fake, "tensorwise", True) is fake.precompute_float8_dynamic_scale_for_fsdp
    assert _float8.precompute_scales(fake, "tensorwise", False) is None
    assert _float8.precompute_scales(fake, "rowwise", True) is None


def test_compile_raises_the_recompile_limit():
    """Raised to at least RECOMPILE_LIMIT under every name this torch has, never lowered; inside dynamo's own
    `config.patch`, which puts the values back (setting them otherwise would leak into every later compile of the
    session: monkeypatch's undo left torch 2.13's aliased `recompile_limit` unreadable)."""
    import torch._dynamo

    config = torch._dynamo.config
    names = [n for n in ("cache_size_limit", "recompile_limit") if hasattr(config, n)]
    key = "recompile_limit" if "recompile_limit" in names else "cache_size_limit"
    before = getattr(config, key)
    with config.patch({key: 8}):
        now = _step_model.raise_recompile_limit()
        assert set(now) == set(names) and all(v == _step_model.RECOMPILE_LIMIT for v in now.values())
    with config.patch({key: 1000}):
        assert all(v == 1000 for v in _step_model.raise_recompile_limit().values())  # never lowered
    assert getattr(config, key) == before  # put back for every later compile in this session


def test_the_compile_flag_says_it_raises_the_limit(capsys):
    with pytest.raises(SystemExit):
        bench_step.parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"recompile limit raised to {_step_model.RECOMPILE_LIMIT}" in help_text


def _row(engine, losses):
    return {"engine": engine, "layout": "zero3:1x1", "losses": losses}


def test_an_fp8_row_is_checked_with_the_fp8_tolerance():
    args = SimpleNamespace(dtype="bf16", loss_steps=3, check_against=None)
    ref = _row("fsdp2", [10.0, 9.0, 8.0])
    near = _row("fsdp2+float8t", [10.01, 9.01, 8.01])  # 1e-3: the format, not a defect
    wrong = _row("fsdp2+float8r", [10.0, 9.5, 8.0])  # 5.6e-2: a defect
    model = _row("model+float8t", [10.01, 3.0, 3.0])  # no optimizer: its first step only
    checks = {c["engine"]: c for c in _loss_check.loss_checks([ref, near, wrong, model], args, world=1)}
    assert checks["fsdp2+float8t"]["ok"] and checks["fsdp2+float8t"]["rtol"] == _loss_check.LOSS_RTOL_FLOAT8
    assert not checks["fsdp2+float8r"]["ok"]
    assert checks["model+float8t"]["ok"] and checks["model+float8t"]["steps_checked"] == 1
    bf16 = _loss_check.loss_checks([ref, _row("hfsdp", [10.01, 9.01, 8.01])], args, world=1)
    assert not bf16[0]["ok"]  # the same difference in a bf16 row is a failure


def test_the_model_float8_rows_run_with_the_single_device_engines():
    rows = [_row("fsdp2", [1.0]), _row("model+float8t", [1.0]), _row("model", [1.0])]
    args = SimpleNamespace(dtype="fp32", loss_steps=1, check_against=None)
    pairs = [c["pair"] for c in _loss_check.loss_checks(rows, args, world=2)]
    assert pairs == ["model+float8t vs model zero3:1x1"]  # the unsharded rows among themselves, against bf16


def test_real_torchao_converts_the_units_only():
    float8 = pytest.importorskip("torchao.float8")
    model = TinyLM()
    label = _float8.convert(model, list(model.layers), "tensorwise", fsdp_all_gather=False, float8=float8)
    converted = {n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"}
    assert converted == {f"layers.{i}.{name}" for i in range(2) for name in ("q_proj", "mlp.0", "mlp.2")}
    assert type(model.lm_head) is nn.Linear and type(model.layers[0].odd) is nn.Linear
    assert "6 unit Linears" in label
