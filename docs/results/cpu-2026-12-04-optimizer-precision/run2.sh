# Second part (started while run.sh's lane a was still running): run.sh's lane b was stopped after its first two
# runs, because on one rank with one microbatch per step bf16 gradients are exact (the bf16 compute already makes
# bf16 gradients, and nothing is summed), so "bf16 grads" repeated fp32 and "bf16 grads+moments" repeated "bf16
# moments" bit for bit. Instead: the last identity check (seed 0), then the settings with bf16 gradients where the
# gradient buffer does sum: 2 microbatches of 2 sequences per step (the engine's accumulation, set_microbatch),
# fp32 reference included. Lane c waits for run.sh's lane a, then runs the fp8 "together" setting the same way.
set -e
cd "$(dirname "$0")/../../.."
out=docs/results/cpu-2026-12-04-optimizer-precision
B="env PYTHONPATH=packages/core/src .venv/bin/python bench/optimizer_precision_quality.py --threads 1"
B="$B --hidden 96 --layers 4 --heads 4 --ffn 256 --seq 128 --rows 4 --eval-rows 256"
MAIN="$B --schedule cosine --steps 1000 --lr 2e-3 --eval-every 250"
lane_b() {
  $MAIN --settings "bf16 grads+fp8 moments" --seeds 0 --out $out/main-b.jsonl
  $MAIN --microbatches 2 --settings fp32 "bf16 grads" "bf16 grads+moments" --seeds 0 1 2 --out $out/accum-b.jsonl
}
lane_c() {
  while kill -0 "$LANE_A" 2>/dev/null; do sleep 5; done
  $MAIN --microbatches 2 --settings "bf16 grads+fp8 moments" --seeds 0 1 2 --out $out/accum-c.jsonl
}
start=$(date +%s)
lane_b >>$out/lane-b.log 2>&1 &
b=$!
lane_c >$out/lane-c.log 2>&1 &
c=$!
wait $b
wait $c
echo "run2 wall time: $(( $(date +%s) - start )) s" | tee -a $out/wall.txt
