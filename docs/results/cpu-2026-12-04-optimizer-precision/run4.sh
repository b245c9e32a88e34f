# Fourth part: fp32 state at twice the learning rate (4e-3), to tell whether what fp8 moments gain at 2e-3 is what
# a larger step gains. Waits for run3.sh's lane e (two processes at most at once).
set -e
cd "$(dirname "$0")/../../.."
out=docs/results/cpu-2026-12-04-optimizer-precision
B="env PYTHONPATH=packages/core/src .venv/bin/python bench/optimizer_precision_quality.py --threads 1"
B="$B --hidden 96 --layers 4 --heads 4 --ffn 256 --seq 128 --rows 4 --eval-rows 256"
while kill -0 "$LANE_E" 2>/dev/null; do sleep 5; done
start=$(date +%s)
$B --schedule cosine --steps 1000 --lr 4e-3 --eval-every 250 --settings fp32 --seeds 0 1 2 --out $out/lr-f.jsonl
echo "run4 wall time: $(( $(date +%s) - start )) s" | tee -a $out/wall.txt
