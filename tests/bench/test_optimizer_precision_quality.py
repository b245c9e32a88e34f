"""The optimizer-precision quality bench: every setting trains (finite losses) and the report reads its lines."""

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
    from optimizer_precision_quality import SETTINGS, summary, table

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
        assert isinstance(row["within_fp32_range"], bool) and len(row["paired_diffs"]) == 2
    assert rows[0]["vs_fp32"] == 0.0 and rows[0]["within_fp32_range"]
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
