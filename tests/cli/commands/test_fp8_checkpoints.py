"""hfsdp's checkpoints and the Hugging Face export across fp8 (issue 39, item 3), through `hfsdp train --device cpu`.

One chain of runs of a tiny Llama (one key/value head, so k_proj and v_proj stay bf16), the global batch fixed at 8:
- `fp8`: hybrid, every layer that fits converted (`--fp8-min-size 0`), `--fp8-param-gather`, HFSDP 2x2 (4 ranks:
  the weights gathered in fp8 on both axes), 2 steps, saved at step 2;
- `bf16`: no fp8 at all, ZeRO-3 1x2 (2 ranks), resumes the fp8 run's step 2 and trains to step 4, saving every step;
- `fp8 resumed` and `fp8 resumed, no gather`: fp8 again on HFSDP 2x2, with and without the fp8 gather, resume the
  bf16 run's step 4 and train to step 6 without gradient clipping, saving every step.
Every resume reshards on load. The weights a resume loaded are the saved ones: the first step after it is AdamW's
update of exactly the saved fp32 main weights, recomputed here from the resumed run's own moments after that step
(its step-3 or step-5 checkpoint). With and without the fp8 gather the resumed fp8 runs are the same bit for bit,
losses and checkpoints: the fp8 weights gathered after a load are quantized from the loaded weights. Every
checkpoint holds fp32 main weights, fp32 moments and a bf16 compute copy equal to the cast of the main weights, and
nothing in fp8. `hfsdp ckpt export` of the fp8 run's checkpoint writes bf16 (its default, the run's dtype) or fp32,
under the model's own names, the cast of the main weights, and transformers loads it with nothing missing.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.support.runs import HFSDP, LLAMA, records

#: One key/value head of 8 channels: k_proj and v_proj (8 outputs) stay bf16, the other Linear layers go fp8.
ONE_KV_HEAD = {**LLAMA, "num_key_value_heads": 1}
FP8 = ["--fp8-format", "hybrid", "--fp8-min-size", "0"]
HFSDP_2X2 = ["--nproc", "4", "--instances", "2", "--outer", "optim"]
ZERO3_1X2 = ["--nproc", "2"]
LAYOUT_NAMES = {
    "HFSDP 2x2": "HFSDP 2x2 (optim over optim_grads_params)",
    "ZeRO-3 1x2": "ZeRO-3 1x2 (optim_grads_params)",
}


def _train(root: Path, name: str, *args: str) -> dict:
    """`hfsdp train` of the tiny Llama into `root/name` (its checkpoints under `root/name/ck`)."""
    directory = root / name
    directory.mkdir(parents=True)
    metrics = directory / "metrics.jsonl"
    common = ["--model-config", str(root / "llama.json"), "--seq-len", "16", "--device", "cpu", "--dtype", "bf16",
              "--global-batch-size", "8", "--lr", "1e-2", "--metrics", str(metrics),
              "--save", str(directory / "ck")]  # fmt: skip
    done = subprocess.run([HFSDP, "train", *common, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return {"stdout": done.stdout, "records": records(metrics), "ck": directory / "ck"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fp8_ckpt")
    (root / "llama.json").write_text(json.dumps(ONE_KV_HEAD))
    out = {"root": root}
    out["fp8"] = _train(root, "fp8", *HFSDP_2X2, *FP8, "--fp8-param-gather", "--steps", "2")
    load = ["--load", str(out["fp8"]["ck"] / "step-2")]
    out["bf16"] = _train(root, "bf16", *ZERO3_1X2, *load, "--steps", "4", "--save-every", "1")
    load = ["--load", str(out["bf16"]["ck"] / "step-4")]
    # No clipping: the fp8 gather puts the fp8 weights in flat groups of their own, so each rank's pieces of the
    # parameters, whose fp32 norms the global norm sums, are cut elsewhere, and the norm can differ in its last bit
    # (the clipped gradients then too): 1.5084163 against 1.5084164 at step 5 here, the losses equal.
    resumed = [*HFSDP_2X2, *FP8, *load, "--steps", "6", "--save-every", "1", "--clip-grad", "0"]
    out["fp8 resumed"] = _train(root, "fp8_resumed", *resumed, "--fp8-param-gather")
    out["fp8 resumed, no gather"] = _train(root, "fp8_resumed_no_gather", *resumed)
    return out


def _whole(step_dir: Path, kind: str) -> dict[str, torch.Tensor]:
    """Every tensor of `kind` in a checkpoint, whole (flattened), by name, whatever layout saved it."""
    from hfsdp.ckpt import read_index
    from hfsdp.ckpt.tensors.reader import CheckpointReader

    index = read_index(step_dir)
    out = {}
    with CheckpointReader(step_dir, index) as reader:
        for name, entry in index.tensors[kind].items():
            out[name] = torch.empty(math.prod(entry.shape), dtype=getattr(torch, entry.dtype))
            reader.read_into(kind, name, 0, out[name])
    return out


def _assert_adamw_step_from(saved: Path, after: Path, lr: float, step: int) -> None:
    """The main weights in `after` (the resumed run's checkpoint one step after the resume) are torch's AdamW update
    of the main weights in `saved` with the moments `after` holds: the resume started from exactly `saved`'s weights
    (a start from other weights, or with the step count lost, would be off by about the learning rate, 1e-2)."""
    from hfsdp.ckpt import read_index

    before, now = _whole(saved, "main"), _whole(after, "main")
    exp_avg, exp_avg_sq = _whole(after, "exp_avg"), _whole(after, "exp_avg_sq")
    groups = read_index(after).optimizer["param_groups"]
    assert before.keys() == now.keys() == {name for group in groups for name in group["params"]}
    for group in groups:
        hyper = group["hyper"]
        (beta1, beta2), eps, decay = hyper["betas"], hyper["eps"], hyper["weight_decay"]
        for name in group["params"]:
            denom = exp_avg_sq[name].sqrt() / math.sqrt(1 - beta2**step) + eps
            expected = before[name] * (1 - lr * decay) - lr / (1 - beta1**step) * exp_avg[name] / denom
            torch.testing.assert_close(now[name], expected, rtol=0, atol=1e-6, msg=name)
            assert not torch.equal(now[name], before[name]), name  # the step moved it


def _resume_line(stdout: str) -> str:
    (line,) = [x for x in stdout.splitlines() if x.startswith("resumed from ")]
    return line


def test_an_fp8_gather_run_resumes_in_a_bf16_run_from_the_weights_it_saved(runs):
    fp8, bf16 = runs["fp8"], runs["bf16"]
    assert [r["step"] for r in fp8["records"]] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in fp8["records"])
    assert not any(x.startswith("fp8 (") for x in bf16["stdout"].splitlines())  # the bf16 run has no fp8 at all
    layouts = f"({LAYOUT_NAMES['HFSDP 2x2']} -> {LAYOUT_NAMES['ZeRO-3 1x2']})"
    assert _resume_line(bf16["stdout"]).startswith(f"resumed from {fp8['ck'] / 'step-2'} {layouts}")
    assert [r["step"] for r in bf16["records"]] == [3, 4]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in bf16["records"])
    _assert_adamw_step_from(fp8["ck"] / "step-2", bf16["ck"] / "step-3", bf16["records"][0]["lr"], 3)


def test_a_bf16_run_resumes_with_fp8_and_its_gather_from_the_weights_it_saved(runs):
    bf16, fp8 = runs["bf16"], runs["fp8 resumed"]
    (line,) = [x for x in fp8["stdout"].splitlines() if x.startswith("fp8 (")]
    assert line.startswith("fp8 (hybrid, tensorwise): 10 of 14 Linear layers in the units multiply in fp8"), line
    layouts = f"({LAYOUT_NAMES['ZeRO-3 1x2']} -> {LAYOUT_NAMES['HFSDP 2x2']})"
    assert _resume_line(fp8["stdout"]).startswith(f"resumed from {bf16['ck'] / 'step-4'} {layouts}")
    assert [r["step"] for r in fp8["records"]] == [5, 6]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in fp8["records"])
    _assert_adamw_step_from(bf16["ck"] / "step-4", fp8["ck"] / "step-5", fp8["records"][0]["lr"], 5)


def test_after_a_resume_the_fp8_gather_trains_bit_for_bit_like_the_layers_quantizing_themselves(runs):
    """The weights gathered in fp8 after the load are those the layers quantize from the loaded weights: the losses
    and every tensor of both checkpoints (weights, main weights, moments) are equal. The gradient norms agree to
    their last bits (the pieces whose norms they sum are cut elsewhere: see `runs`)."""
    gather, plain = runs["fp8 resumed"], runs["fp8 resumed, no gather"]
    assert [r["loss"] for r in gather["records"]] == [r["loss"] for r in plain["records"]]
    for a, b in zip(gather["records"], plain["records"], strict=True):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)
    for step in ("step-5", "step-6"):
        for kind in ("model", "main", "exp_avg", "exp_avg_sq"):
            with_gather, without = _whole(gather["ck"] / step, kind), _whole(plain["ck"] / step, kind)
            assert with_gather.keys() == without.keys()
            for name, tensor in with_gather.items():
                assert torch.equal(tensor, without[name]), (step, kind, name)


@pytest.mark.parametrize("run", ["fp8", "bf16", "fp8 resumed"])
def test_every_checkpoint_holds_fp32_masters_and_their_bf16_cast_and_nothing_in_fp8(runs, run):
    """An fp8 run's compute copy (gathered in fp8 on both of HFSDP's axes while it trained) is saved as the bf16
    cast of its main weights, as a bf16 run's is."""
    from hfsdp.ckpt import read_index

    for step_dir in sorted(runs[run]["ck"].glob("step-*")):
        dtypes = {kind: {e.dtype for e in entries.values()} for kind, entries in read_index(step_dir).tensors.items()}
        assert dtypes == {"model": {"bfloat16"}, "main": {"float32"}, "exp_avg": {"float32"},
                          "exp_avg_sq": {"float32"}}, (step_dir, dtypes)  # fmt: skip
        main, model = _whole(step_dir, "main"), _whole(step_dir, "model")
        assert main.keys() == model.keys()
        for name, weights in main.items():
            assert torch.equal(model[name], weights.to(torch.bfloat16)), (step_dir, name)


@pytest.mark.parametrize("dtype", [None, "fp32"])
def test_the_hugging_face_export_of_an_fp8_run_has_no_fp8_and_loads_into_transformers(runs, dtype):
    """`hfsdp ckpt export --format hf` of the fp8 gather run's checkpoint: by default bf16 (the run's --dtype),
    with --dtype fp32 the main weights exactly; only that dtype in the files, the model's own names, the cast of
    the fp32 main weights, and transformers' from_pretrained finds every weight and computes a finite loss."""
    from transformers import AutoModelForCausalLM

    step_dir = runs["fp8"]["ck"] / "step-2"
    out = runs["root"] / f"export-{dtype}"
    args = [] if dtype is None else ["--dtype", dtype]
    done = subprocess.run([HFSDP, "ckpt", "export", str(step_dir), str(out), "--format", "hf", *args],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    want = torch.float32 if dtype == "fp32" else torch.bfloat16
    exported, dtypes = {}, set()
    for path in sorted(out.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118
                dtypes.add(f.get_slice(key).get_dtype())
                exported[key] = f.get_tensor(key)
    assert dtypes == {"F32" if dtype == "fp32" else "BF16"}, dtypes
    main = _whole(step_dir, "main")
    assert exported.keys() == main.keys()
    for name, weights in main.items():
        assert torch.equal(exported[name].reshape(-1), weights.to(want)), name
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    assert set(model.state_dict()) == exported.keys()
    assert all(p.dtype == want for p in model.parameters())
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, exported[name]), name
    ids = torch.randint(0, ONE_KV_HEAD["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert math.isfinite(model(input_ids=ids, labels=ids).loss.item())
