#!/usr/bin/env bash
# One device call: the step benchmark on 2 GPUs (and 1 unless SKIP_ONE=1), save -> offline reshard -> resume on
# GPU, then the fp32 losses of every 2-GPU layout against 1 GPU (when LAYOUTS=1).
# Usage (on the GPU machine, with the packages on PYTHONPATH): bash bench/gpu_session.sh OUT_DIR
set -u
out=${1:?output directory}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
M="--dtype bf16 --layers 16 --hidden 2048 --heads 16 --vocab 32000 --seq-len 2048 --micro-batch-size 4 --steps 15 --warmup 3"
timeout 240 torchrun --nproc-per-node 2 bench/bench_step.py --device cuda $M \
  --layouts zero3:1x2,hsdp:2x1,hfsdp:2x1 --engines hfsdp,fsdp2 --profile --out "$out/two.json" >"$out/two.log" 2>&1
tail -45 "$out/two.log"
if [ "${SKIP_ONE:-0}" != 1 ]; then
  timeout 150 torchrun --nproc-per-node 1 bench/bench_step.py --device cuda $M \
    --layouts zero3:1x1 --engines hfsdp,fsdp2,plain --out "$out/one.json" >"$out/one.log" 2>&1
  grep -A6 "## Step time" "$out/one.log"
fi
# Checkpoint on GPUs: HFSDP 2x1 for 2 steps, reshard offline to 1 GPU, resume to step 4.
S="--layers 4 --hidden 512 --heads 8 --vocab 8192 --seq-len 512 --global-batch-size 8 --micro-batch-size 2 --device cuda"
ck=/tmp/hfsdp-ck
rm -rf $ck $ck-1
python3 -m hfsdp.cli train --nproc 2 --instances 2 --outer optim --steps 4 --metrics "$out/whole.jsonl" $S >"$out/ck.log" 2>&1
python3 -m hfsdp.cli train --nproc 2 --instances 2 --outer optim --steps 2 --save $ck $S >>"$out/ck.log" 2>&1
python3 -m hfsdp.cli ckpt reshard $ck $ck-1 --world-size 1 --instances 1 --outer no_shard >>"$out/ck.log" 2>&1
python3 -m hfsdp.cli train --nproc 1 --steps 4 --load $ck-1 --metrics "$out/resumed.jsonl" $S >>"$out/ck.log" 2>&1
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
whole = [json.loads(line) for line in open(f"{out}/whole.jsonl")]
resumed = [json.loads(line) for line in open(f"{out}/resumed.jsonl")]
for r in resumed:
    w = whole[r["step"] - 1]
    print(f"step {r['step']}: uninterrupted 2 GPUs {w['loss']:.6f}  resumed on 1 GPU {r['loss']:.6f}  rel {abs(r['loss'] - w['loss']) / w['loss']:.2e}")
PY
if [ "${LAYOUTS:-0}" = 1 ]; then
  timeout 200 python3 bench/gpu_layouts.py --out-dir /tmp/hfsdp-layouts --device cuda --gpus 2 --dtype fp32 --steps 4 \
    --only "1 rank,ZeRO-3 1x2,HSDP 2x1,HFSDP 2x1" >"$out/layouts.log" 2>&1
  tail -12 "$out/layouts.log"
fi
