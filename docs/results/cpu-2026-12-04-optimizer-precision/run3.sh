# Third part: the low-lr runs that run.sh's stopped lane b would have made, then the same cosine runs with
# beta2 0.95 (fp32, bf16 moments, fp8 moments). Lane d waits for run2.sh's lane b, lane e for its lane c, so that
# two processes at most run at once.
set -e
cd "$(dirname "$0")/../../.."
out=docs/results/cpu-2026-12-04-optimizer-precision
B="env PYTHONPATH=packages/core/src .venv/bin/python bench/optimizer_precision_quality.py --threads 1"
B="$B --hidden 96 --layers 4 --heads 4 --ffn 256 --seq 128 --rows 4 --eval-rows 256"
MAIN="$B --schedule cosine --steps 1000 --lr 2e-3 --eval-every 250"
LOW="$B --schedule lowlr --steps 400 --lr 2e-3 --low-after 200 --low-lr 1e-5 --eval-every 200"
lane_d() {
  while kill -0 "$LANE_B" 2>/dev/null; do sleep 5; done
  $LOW --settings "fp8 moments" --seeds 0 1 2 --out $out/lowlr-d.jsonl
  $LOW --settings "bf16 moments" --seeds 1 2 --out $out/lowlr-d.jsonl
  $MAIN --beta2 0.95 --settings fp32 --seeds 0 1 2 --out $out/beta2-d.jsonl
  $MAIN --beta2 0.95 --settings "bf16 moments" --seeds 0 --out $out/beta2-d.jsonl
}
lane_e() {
  while kill -0 "$LANE_C" 2>/dev/null; do sleep 5; done
  $MAIN --beta2 0.95 --settings "bf16 moments" --seeds 1 2 --out $out/beta2-e.jsonl
  $MAIN --beta2 0.95 --settings "fp8 moments" --seeds 0 1 2 --out $out/beta2-e.jsonl
}
start=$(date +%s)
lane_d >$out/lane-d.log 2>&1 &
d=$!
lane_e >$out/lane-e.log 2>&1 &
e=$!
wait $d
wait $e
echo "run3 wall time: $(( $(date +%s) - start )) s (most of it waiting for run2.sh)" | tee -a $out/wall.txt
