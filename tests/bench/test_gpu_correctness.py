"""The GPU correctness script runs on a CPU too (gloo, no sanitizer), passes on a correct engine, and its judge
fails a run that is not deterministic or starts from another loss, however close the later steps are."""

import copy
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_correctness  # noqa: E402


def test_the_script_passes_on_two_cpu_ranks_with_the_hybrid_layouts(tmp_path):
    """Two gloo ranks: ZeRO-3 1x2, HSDP and HFSDP 2x1, eager and `module.compile()`, FusedAdamW, against FSDP2."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(gpu_correctness.SRC))
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_correctness.py"), str(tmp_path), "--device", "cpu", "--small"]
    cmd += ["--nproc", "2", "--steps", "2", "--styles", "eager,module", "--options", "fused"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    report = (tmp_path / "report.md").read_text()
    assert "**PASS**: 0 of" in report
    verdicts = json.loads((tmp_path / "results.json").read_text())["verdicts"]
    checked = {(v["check"], v["case"]) for v in verdicts}
    assert ("deterministic across processes", "hfsdp/module@hfsdp") in checked
    assert ("agrees with fsdp2/module@hsdp", "hfsdp/module@hfsdp") in checked
    assert ("agrees with fsdp2/eager", "hfsdp/eager") in checked
    with tarfile.open(tmp_path / "logs.tgz") as tar:  # every pass's log and JSON, in one file that comes back
        assert {"main.log", "main.json", "second.log", "second.json"} <= set(tar.getnames())


def _verdicts(records, argv):
    args = gpu_correctness.parse_args(argv)
    return gpu_correctness.judge(records, gpu_correctness.plan(args))


def _fabricated(argv) -> dict:
    """A main and a second pass where every case trained the same losses and weights."""
    args = gpu_correctness.parse_args(argv)
    passes = gpu_correctness.plan(args)
    result = {"losses": [10.0, 9.5, 9.0], "digest": "d", "error": None}
    records = {}
    for name, cases in passes.items():
        rows = []
        for case in cases:
            row = dict(result, case=case.name, repeat=case.repeat)
            row["weights_rel"] = {w: 0.0 for w in case.witnesses}
            rows.append(row)
        records[name] = {"results": rows}
    return records


def test_the_judge_fails_what_is_not_deterministic_or_starts_elsewhere():
    """The same records pass; a second run that differs in one weight, or a compiled case whose first loss is off
    by 1e-6 (a forward that read other weights), fails its check."""
    argv = ["out", "--no-sanitizer", "--styles", "eager,module", "--options", ""]
    records = _fabricated(argv)
    assert all(v["ok"] for v in _verdicts(records, argv))

    racy = copy.deepcopy(records)
    for row in racy["main"]["results"]:
        if row["case"] == "hfsdp/module" and row["repeat"] == 1:
            row["digest"] = "other"
    failed = {(v["check"], v["case"]) for v in _verdicts(racy, argv) if not v["ok"]}
    assert failed == {("deterministic in one process", "hfsdp/module")}

    wrong = copy.deepcopy(records)
    for row in wrong["main"]["results"]:
        if row["case"] == "hfsdp/module" and row["repeat"] == 0:
            row["losses"] = [10.00001, 9.5, 9.0]
    failed = {(v["check"], v["case"]) for v in _verdicts(wrong, argv) if not v["ok"]}
    assert ("agrees with reference/module", "hfsdp/module") in failed
    assert ("deterministic across processes", "hfsdp/module") in failed


def test_one_rank_runs_the_fp8_gather_and_the_collectives_a_larger_mesh_would(tmp_path):
    """One gloo rank, the options that build hfsdp under `single_rank_collectives()`: plain bf16 ("comms"), fp8
    tensorwise gathered in fp8, the same with FusedAdamW's prestaged, overlapped step, and FusedAdamW keeping the
    masters as bf16 weights plus remainders (gathered from the kept bf16 shard, in bf16 and in fp8). Each passes
    against the reference of its arithmetic and issued the gathers and reduce-scatters (the fp8 weights in one
    byte)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(gpu_correctness.SRC))
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_correctness.py"), str(tmp_path), "--device", "cpu", "--small"]
    cmd += ["--steps", "2", "--styles", "eager", "--options", "comms,fp8t,fp8t_fused_clip_prestage_overlap"]
    cmd[-1] += ",fused_clip_prestage_rem,fp8t_fused_clip_prestage_rem"
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    verdicts = json.loads((tmp_path / "results.json").read_text())["verdicts"]
    passed = {(v["check"], v["case"]) for v in verdicts if v["ok"]}
    assert ("agrees with reference/eager", "hfsdp/eager/comms") in passed
    assert ("agrees with reference/eager/fp8t", "hfsdp/eager/fp8t") in passed
    fused = "hfsdp/eager/fp8t_fused_clip_prestage_overlap"
    assert ("agrees with reference/eager/fp8t_fused", fused) in passed
    assert ("deterministic across processes", fused) in passed
    split = "hfsdp/eager/fused_clip_prestage_rem"  # masters as bf16 weights plus remainders
    assert ("agrees with reference/eager/fused_rem", split) in passed
    assert ("agrees with reference/eager/fp8t_fused_rem", "hfsdp/eager/fp8t_fused_clip_prestage_rem") in passed
    with tarfile.open(tmp_path / "logs.tgz") as tar:
        main = json.load(tar.extractfile("main.json"))
    issued = {r["case"]: set(r["collectives"] or ()) for r in main["results"] if r["case"].startswith("hfsdp")}
    assert issued["hfsdp/eager"] == set()  # one rank plans no collective of its own
    assert {"all_gather:2", "reduce_scatter:4"} <= issued["hfsdp/eager/comms"]
    for case in ("hfsdp/eager/fp8t", fused):
        assert {"all_gather:1", "all_gather:2"} <= issued[case]
