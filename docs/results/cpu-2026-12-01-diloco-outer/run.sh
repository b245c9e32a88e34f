set -e
cd /work/main
common="--device cpu --hidden 128 --layers 2 --heads 4 --ffn 256 --seq 128 --rows 8 --steps 400 --seeds 0 1"
PYTHONPATH=packages/core/src .venv/bin/python bench/bench_diloco.py $common --only HSDP "DiLoCo H=10" "DiLoCo H=50" --out /tmp/dlcpu/a.jsonl > /tmp/dlcpu/a.log 2>&1
PYTHONPATH=packages/core/src .venv/bin/python bench/bench_diloco.py $common --outer-momentum 0 --only "DiLoCo H=10" "DiLoCo H=50" --out /tmp/dlcpu/b.jsonl > /tmp/dlcpu/b.log 2>&1
PYTHONPATH=packages/core/src .venv/bin/python bench/bench_diloco.py $common --outer-lr 1.0 --outer-momentum 0 --only "DiLoCo H=10" "DiLoCo H=50" --out /tmp/dlcpu/c.jsonl > /tmp/dlcpu/c.log 2>&1
echo done > /tmp/dlcpu/done
