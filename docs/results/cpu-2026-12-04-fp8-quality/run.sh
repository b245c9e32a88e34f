# FP8 compute against quality (issue 39, item 5) on this 2-core CPU box (2026-12-04).
# The code is the commit given as $1 (default: HEAD), taken out with git archive, so that work in the checkout
# meanwhile cannot reach the runs. Two lanes of one process each (one thread each), side by side.
set -e
cd "$(dirname "$0")/../../.."
commit=$(git rev-parse "${1:-HEAD}")
out=docs/results/cpu-2026-12-04-fp8-quality
snap=$(mktemp -d)
git archive "$commit" packages/core/src bench | tar -x -C "$snap"
B="env PYTHONPATH=$snap/packages/core/src .venv/bin/python $snap/bench/optimizer_precision_quality.py --threads 1"
B="$B --hidden 96 --layers 4 --heads 4 --ffn 256 --seq 128 --rows 4 --eval-rows 256"
MAIN="$B --schedule cosine --steps 1000 --lr 2e-3 --eval-every 250"
LOW="$B --schedule lowlr --steps 400 --lr 2e-3 --low-after 200 --low-lr 1e-5 --eval-every 200"
{
  lscpu | head -20; nproc; .venv/bin/python -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version)"
  echo "commit $commit (git archive of packages/core/src and bench into $snap)"; date -u
} >$out/env.txt 2>&1
lane_a() {
  $MAIN --settings bf16 "fp8 tensorwise hybrid" --seeds 0 1 2 --out $out/main-a.jsonl
  $LOW --settings bf16 "fp8 tensorwise hybrid" --seeds 0 1 2 --out $out/lowlr-a.jsonl
}
lane_b() {
  $MAIN --settings "fp8 tensorwise e4m3" "fp8 rowwise e4m3" --seeds 0 1 2 --out $out/main-b.jsonl
}
start=$(date +%s)
lane_a >$out/lane-a.log 2>&1 &
a=$!
lane_b >$out/lane-b.log 2>&1 &
b=$!
wait $a
wait $b
echo "wall time: $(( $(date +%s) - start )) s" | tee $out/wall.txt
$B --report $out/main-a.jsonl $out/main-b.jsonl $out/lowlr-a.jsonl >$out/report.txt
rm -rf "$snap"
