# DiLoCo at small H on this 2-core CPU box (2026-12-02): the 0.4M-parameter model of ../cpu-2026-12-01-diloco-outer,
# whose a.jsonl holds the HSDP baseline for the same seeds. About 20 minutes in all.
set -e
cd "$(dirname "$0")/../../.."
out=docs/results/cpu-2026-12-02-diloco-small-h
B="env PYTHONPATH=packages/core/src .venv/bin/python bench/bench_diloco.py --device cpu --hidden 128 --layers 2"
B="$B --heads 4 --ffn 256 --seq 128 --rows 8 --steps 400 --seeds 0 1 --sync-every 1 2 5"
$B --outer-lr 1.0 --outer-momentum 0 --only "DiLoCo H=2" "DiLoCo H=5" --out $out/d.jsonl >$out/d.log 2>&1
$B --only "DiLoCo H=2" "DiLoCo H=5" --out $out/e.jsonl >$out/e.log 2>&1
$B --outer-lr 1.0 --outer-momentum 0 --only "DiLoCo H=1" --out $out/f.jsonl >$out/f.log 2>&1
