# Optimizer-state precision against quality (issue 38, item 5) on this 2-core CPU box (2026-12-04).
# Two lanes of one process each (one thread each), side by side; each lane runs its runs in turn.
# As run: lane a ran to its end (15:32:28 to about 15:51:30 UTC); lane b and this script were stopped at 15:40:5x after lane
# b's first two runs (see run2.sh for why and what ran instead; run3.sh and run4.sh for the rest). The last line
# (the report) did not run here; report.txt was made afterwards with the command at its top.
set -e
cd "$(dirname "$0")/../../.."
out=docs/results/cpu-2026-12-04-optimizer-precision
B="env PYTHONPATH=packages/core/src .venv/bin/python bench/optimizer_precision_quality.py --threads 1"
B="$B --hidden 96 --layers 4 --heads 4 --ffn 256 --seq 128 --rows 4 --eval-rows 256"
MAIN="$B --schedule cosine --steps 1000 --lr 2e-3 --eval-every 250"
LOW="$B --schedule lowlr --steps 400 --lr 2e-3 --low-after 200 --low-lr 1e-5 --eval-every 200"
{
  lscpu | head -20; nproc; .venv/bin/python -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version)"
  git rev-parse HEAD; date -u
} >$out/env.txt 2>&1
lane_a() {
  $MAIN --settings fp32 "bf16 moments" "fp8 moments" --seeds 0 1 2 --out $out/main-a.jsonl
  $LOW --settings fp32 --seeds 0 1 2 --out $out/lowlr-a.jsonl
  $LOW --settings "bf16 moments" --seeds 0 --out $out/lowlr-a.jsonl
}
lane_b() {
  $MAIN --settings "bf16 grads" "bf16 grads+moments" "bf16 grads+fp8 moments" --seeds 0 1 2 --out $out/main-b.jsonl
  $LOW --settings "fp8 moments" --seeds 0 1 2 --out $out/lowlr-b.jsonl
  $LOW --settings "bf16 moments" --seeds 1 2 --out $out/lowlr-b.jsonl
}
start=$(date +%s)
lane_a >$out/lane-a.log 2>&1 &
a=$!
lane_b >$out/lane-b.log 2>&1 &
b=$!
wait $a
wait $b
echo "wall time: $(( $(date +%s) - start )) s" | tee $out/wall.txt
$B --report $out/main-a.jsonl $out/main-b.jsonl $out/lowlr-a.jsonl $out/lowlr-b.jsonl >$out/report.txt
