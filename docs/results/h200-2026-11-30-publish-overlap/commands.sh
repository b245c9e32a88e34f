out=$1
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
timeout 130 python3 bench/gpu_layouts.py --out-dir /tmp/hfsdp-layouts --device cuda --gpus 2 --dtype fp32 --steps 4 \
  --only "1 rank,HFSDP 2x1,ZeRO-1 1x2" >"$out/layouts.log" 2>&1
tail -6 "$out/layouts.log"
M="--dtype bf16 --layers 16 --hidden 2048 --heads 16 --vocab 32000 --seq-len 2048 --micro-batch-size 4 --steps 15 --warmup 3"
timeout 230 torchrun --nproc-per-node 2 bench/bench_step.py --device cuda $M --layouts hfsdp:2x1 --engines hfsdp,fsdp2 \
  --rounds 2 --profile --out "$out/hfsdp.json" >"$out/hfsdp.log" 2>&1
grep -v "Warning\|warn(\|DEPRECATED" "$out/hfsdp.log" | grep -A12 "## Step time\|## Profile" | head -30
S="--layers 4 --hidden 512 --heads 8 --vocab 8192 --seq-len 512 --global-batch-size 8 --micro-batch-size 2 --device cuda"
ck=/tmp/hfsdp-ck; rm -rf $ck $ck-1
python3 -m hfsdp.cli train --nproc 2 --instances 2 --outer optim --steps 4 --metrics "$out/whole.jsonl" $S >"$out/ck.log" 2>&1
python3 -m hfsdp.cli train --nproc 2 --instances 2 --outer optim --steps 2 --save $ck $S >>"$out/ck.log" 2>&1
python3 -m hfsdp.cli train --nproc 2 --instances 2 --outer optim --steps 4 --load $ck --metrics "$out/same.jsonl" $S >>"$out/ck.log" 2>&1
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
whole = [json.loads(l) for l in open(f"{out}/whole.jsonl")]
same = [json.loads(l) for l in open(f"{out}/same.jsonl")]
for r in same:
    w = whole[r["step"] - 1]
    print(f"step {r['step']}: uninterrupted {w['loss']!r} resumed same layout {r['loss']!r} equal={w['loss'] == r['loss']}")
PY
