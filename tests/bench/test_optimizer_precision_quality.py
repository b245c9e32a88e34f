"""The precision quality bench: every optimizer-precision and fp8 setting trains (finite losses), the report reads its
lines, and the --device cuda path plans the 0.95B run without a GPU."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--hidden", "32", "--layers", "1", "--heads", "2", "--ffn", "64", "--seq", "32", "--rows", "2"]
TINY += ["--eval-rows", "4", "--seeds", "0", "1"]


def bench(out: Path, *extra: str) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "packages" / "core" / "src"))
    env.pop("MASTER_PORT", None)
    cmd = [sys.executable, str(ROOT / "bench" / "optimizer_precision_quality.py"), *TINY, *extra, "--out", str(out)]
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=120)
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def test_every_setting_trains_and_the_report_compares_it_with_fp32(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    from optimizer_precision_quality import OPTIMIZER_SETTINGS as SETTINGS
    from optimizer_precision_quality import summary, table

    main = bench(tmp_path / "main.jsonl", "--steps", "6", "--eval-every", "3")
    low = bench(tmp_path / "low.jsonl", "--steps", "6", "--eval-every", "2", "--schedule", "lowlr", "--low-after", "2",
                "--settings", "fp32", "fp8 moments")  # fmt: skip
    accum = bench(tmp_path / "accum.jsonl", "--steps", "6", "--eval-every", "3", "--microbatches", "2",
                  "--settings", "fp32", "bf16 grads", "--seeds", "0")  # fmt: skip
    assert len(main) == 2 * len(SETTINGS) and len(low) == 4 and len(accum) == 2
    for r in main + low:
        assert set(r["evals"]) == ({"3", "6"} if r["schedule"] == "cosine" else {"2", "4", "6"})
        assert all(math.isfinite(v) for v in r["evals"].values()) and r["nonfinite_train_losses"] == 0
        assert r["train_curve"][0][0] == 1 and math.isfinite(r["train_curve"][0][1])
        assert r["eval_loss"] == r["evals"]["6"] < math.log(256) + 0.5
    dtypes = {r["setting"]: r["optimizer_dtypes"] for r in main}
    assert dtypes["fp32"] == ["torch.float32", "torch.float32"]
    assert dtypes["bf16 moments"] == ["torch.bfloat16", "torch.bfloat16"]
    assert dtypes["fp8 moments"] == ["torch.float8_e4m3fn", "torch.float8_e5m2"]
    assert {r["backends_used"][0] for r in main} == {"torch"}
    by_seed = {(r["setting"], r["seed"]): r["eval_loss"] for r in main}
    assert by_seed[("fp8 moments", 0)] != by_seed[("fp32", 0)]  # the setting reached the optimizer
    # one rank, one microbatch: the bf16 compute's gradients are bf16 already and nothing is summed, so a bf16
    # gradient buffer changes nothing; with two microbatches it sums in bf16
    assert by_seed[("bf16 grads", 0)] == by_seed[("fp32", 0)]
    assert by_seed[("bf16 grads+moments", 0)] == by_seed[("bf16 moments", 0)]
    assert accum[0]["microbatches"] == 2 and accum[0]["eval_loss"] != accum[1]["eval_loss"]

    rows = summary(main + low)
    assert [r["schedule"] for r in summary(accum)] == ["cosine, 2 microbatches"] * 2
    assert [(r["schedule"], r["setting"]) for r in rows] == [
        *(("cosine", s.name) for s in SETTINGS),
        ("lowlr", "fp32"),
        ("lowlr", "fp8 moments"),
    ]
    for row in rows:
        assert row["seeds"] == [0, 1] and row["min"] <= row["mean"] <= row["max"]
        assert row["baseline"] == "fp32" and len(row["paired_diffs"]) == 2
        assert isinstance(row["within_baseline_range"], bool)
    assert rows[0]["vs_baseline"] == 0.0 and rows[0]["vs_baseline_pct"] == 0.0 and rows[0]["within_baseline_range"]
    assert "low_phase_gain" in rows[-1] and math.isfinite(rows[-1]["low_phase_gain"])
    assert table(rows).count("\n") == len(rows) + 1


def test_decay_probe_reads_every_moment_dtype_back_in_fp32():
    sys.path.insert(0, str(ROOT / "bench"))
    from optimizer_precision_quality import decay_probe

    seen = decay_probe(numel=256, steps=60, drop=20, marks=(20, 60))
    assert len(seen) == 6 and all(set(v) == {20, 60} for v in seen.values())
    assert all(math.isfinite(x) and x > 0 for v in seen.values() for x in v.values())
    fp32 = seen["beta2 0.95 fp32"]
    assert 0.5 < fp32[20] < 2 and fp32[60] < 0.1  # E[g^2]: 1, then 0.01 (beta2 0.95 forgets in ~20 steps)


def test_fp8_settings_train_and_record_their_conversion(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    from optimizer_precision_quality import summary, table

    names = ["fp32", "bf16", "fp8 tensorwise hybrid", "fp8 rowwise e4m3"]
    runs = bench(tmp_path / "fp8.jsonl", "--steps", "4", "--eval-every", "4", "--seeds", "0", "--settings", *names)
    by = {r["setting"]: r for r in runs}
    assert list(by) == names
    for r in runs:
        assert r["nonfinite_train_losses"] == 0 and math.isfinite(r["eval_loss"]) and r["device"] == "cpu"
        assert r["compute"] == "bf16" and r["backends_used"] == ["torch"]
        assert (r["eval_rows"], r["eval_every"]) == (4, 4) and r["corpus"]["files"] > 0
    # one layer: qkv, proj, gate_up and down, every dimension a multiple of 16
    assert by["fp8 tensorwise hybrid"]["fp8_summary"] == (
        "fp8 (hybrid, tensorwise): 4 of 4 Linear layers in the units multiply in fp8"
    )
    assert by["fp8 rowwise e4m3"]["fp8_summary"].startswith("fp8 (e4m3, rowwise): 4 of 4")
    assert by["fp8 tensorwise hybrid"]["fp8_format"] == "hybrid" and by["fp8 rowwise e4m3"]["fp8_recipe"] == "rowwise"
    assert by["bf16"]["fp8_summary"] is None
    assert by["bf16"]["evals"] == by["fp32"]["evals"]  # one run under two names: bf16 compute, fp32 state
    assert by["fp8 tensorwise hybrid"]["eval_loss"] != by["bf16"]["eval_loss"]  # the matmuls did change

    rows = summary([r for r in runs if r["setting"] != "fp32"])
    assert [r["setting"] for r in rows] == names[1:] and {r["baseline"] for r in rows} == {"bf16"}
    fp8 = rows[1]
    assert fp8["vs_baseline_pct"] == 100 * (fp8["mean"] - rows[0]["mean"]) / rows[0]["mean"] != 0
    assert "| cosine | fp8 tensorwise hybrid |" in table(rows)


GPU_SHAPE = ["--layers", "16", "--hidden", "2048", "--ffn", "5632", "--heads", "16", "--seq", "2048", "--rows", "8"]


def test_the_cuda_run_plans_the_large_model_without_a_gpu(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "packages" / "core" / "src"))
    settings = ["bf16", "bf16 moments", "fp8 moments"] + [f"fp8 {r}" for r in ("tensorwise hybrid", "tensorwise e4m3")]
    settings.append("fp8 rowwise e4m3")
    cmd = [sys.executable, str(ROOT / "bench" / "optimizer_precision_quality.py"), "--device", "cuda", "--dry-run",
           *GPU_SHAPE, "--steps", "300", "--settings", *settings, "--out", str(tmp_path / "none.jsonl")]  # fmt: skip
    done = subprocess.run(cmd, check=True, env=env, capture_output=True, text=True, timeout=120)
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [line["setting"] for line in lines] == settings and not (tmp_path / "none.jsonl").exists()
    for line in lines:
        assert (line["device"], line["process_group"], line["optimizer_backend"]) == ("cuda:0", "nccl", "auto")
        assert line["compute"] == "bf16" and line["params"] == 823_199_744 and line["tokens_per_step"] == 16384
        assert line["shape"] == {"hidden": 2048, "layers": 16, "heads": 16, "ffn": 5632, "vocab": 256, "seq": 2048}
        if line["setting"].startswith("fp8 ") and "moments" not in line["setting"]:
            assert "64 of 64 Linear layers in the units multiply in fp8" in line["fp8"]
        else:
            assert line["fp8"] is None
    # hfsdp train's default size rule converts none of this shape's layers: the script's default min size is 0
    cmd[cmd.index("--settings") + 1 :] = ["fp8 tensorwise hybrid", "--fp8-min-size", "2048"]
    done = subprocess.run(cmd, check=True, env=env, capture_output=True, text=True, timeout=120)
    assert "0 of 64 Linear layers" in json.loads(done.stdout)["fp8"]


def test_cuda_without_a_gpu_is_refused_before_anything_starts():
    sys.path.insert(0, str(ROOT / "bench"))
    import optimizer_precision_quality as bench_module
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    args = bench_module.parse_args(["--device", "cuda", "--settings", "bf16"])
    with pytest.raises(SystemExit, match="--device cuda: torch sees no CUDA device"):
        bench_module.run(args)
