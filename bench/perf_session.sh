#!/usr/bin/env bash
# Issue 24 in one device call (one H200; the 2-GPU phase runs only where 2 GPUs are present):
#   env           versions, GPU, host memory
#   check         bench/perf_checks.py: FusedAdamW's Triton kernel = its torch path bit for bit and within 1e-6 of
#                 float64; the engine with FusedAdamW and with a share offloaded against hfsdp with torch's AdamW;
#                 the kernel's speed against torch's fused AdamW and a copy
#   floor3b       Llama 3.0B (28 layers, hidden 3072, ffn 8192, GQA 24/8 heads), eager, micro-batch 2: the model
#                 alone, hfsdp (torch fused AdamW), hfsdp+fused, +clip, +prestage, FSDP2; MFU; the bandwidth floor
#   h67, f67      Llama 6.7B (32 x 4096, ffn 11008), micro-batch 1, no offload: hfsdp (and +fused+clip+prestage),
#                 then FSDP2, each in its own process
#   o67full       the 6.7B with all of the optimizer state offloaded (hfsdp --offload-fraction 1)
#   largest       bench/largest_model.py: the largest Llama that trains (recompute, offload='auto'), largest
#                 predicted first; FSDP2 at that size where it is predicted to fit
#   o67half       the 6.7B with half offloaded
#   fsdp2off67    FSDP2 CPUOffloadPolicy at 6.7B (host-memory bound: in the issue it was killed by the OOM killer)
#   l13           hfsdp at 13.0B (Llama-2-13B's shape, recompute, offload='auto'), alone, with the host's free memory
#                 sampled every second into OUT/l13-mem.log: why the largest-model search's first try fails
#   fsdp2big      FSDP2 CPUOffloadPolicy at 11.75B, the largest size hfsdp trains (predicted not to fit the host)
#   correct       bench/gpu_correctness.py: determinism, agreement with a plain reference and FSDP2, the stream
#                 sanitizer (report.md and results.json in OUT/correct)
#   default3b     the 3.0B Llama with hfsdp train's defaults (FusedAdamW, clip in its step, prestaged gathers) against
#                 torch's AdamW, FSDP2, Megatron-FSDP and the model alone; MFU; the bandwidth floor
#   e095, c095    the 0.95B Llama (16 x 2048, micro-batch 4), eager and with unit.compile(): hfsdp's default, FSDP2,
#                 Megatron-FSDP (and its v2, eager), the model alone
#   mfu3b         the 3.0B compiled, and compiled with Liger's kernels (RMSNorm, SwiGLU, RoPE, output projection fused
#                 with the loss): hfsdp's default and the model alone
#   mfu3bmb4      the 3.0B compiled at micro-batch 4 (the engine's per-step cost spread over twice the tokens):
#                 hfsdp's default, FSDP2, Megatron-FSDP, the model alone
#   train3b       hfsdp train itself on the 3.0B Llama (bench/configs/llama-3.0b.json), every layer compiled, its
#                 defaults (2 microbatches of 2 per step, FusedAdamW, clip 1.0): MFU as it reports it; then 4 steps
#                 eager, the reference its losses are checked against
#                 (and with --overlap-step: the optimizer step overlapping the next forward)
#   train095      the same for the 0.95B Llama (2 microbatches of 4)
#   train3bmb4, train095mb8
#                 hfsdp train compiled (and eager, the reference) at one microbatch of 4 (3.0B) or 8 (0.95B) per step
#   c095mb8       the 0.95B compiled at micro-batch 8: hfsdp's default, FSDP2, Megatron-FSDP, the model alone
#   prof3b        hfsdp train 3.0B compiled (2 x 2) with --profile-steps 5-6, and bench/trace_gaps.py on its trace:
#                 how long the GPU sat idle in a step, and what the host was doing then
#   mfu3bm2       the 3.0B compiled, 2 microbatches of 2 per step (hfsdp train's default accumulation): hfsdp's
#                 default, FSDP2, the model alone (losses checked in the run)
#   c095m2        the 0.95B compiled, 2 microbatches of 4: hfsdp's default, FSDP2, the model alone
#   probe         bench/overlap_probe.py at 0.95B and 3.0B: how much of the AdamW pass one GPU hides behind the
#                 model's forward (and backward) on a second stream
#   ligerdbg      Liger under layer.compile() at 0.95B: FSDP2, then hfsdp's default with CUDA_LAUNCH_BLOCKING=1
#                 (each its own process: does the illegal memory access follow hfsdp's flat buffers?)
#   ligerkeep     Liger under layer.compile() at 0.95B with every unit's parameters kept gathered through backward
#                 (hfsdp's default + keep), and with plain hfsdp (torch's AdamW, no prestaged gathers)
#   ligernorms    Liger's kernels but its RMSNorm, under layer.compile() at 0.95B: hfsdp's default, FSDP2, the model
#   keep3b        the 3.0B compiled, micro-batch 4 and 2 x 2: hfsdp's default with and without keep, FSDP2
#   overlap       FusedAdamW's step overlapping the next forward (hfsdp's default + overlap), timed back to back
#                 (no synchronisation between steps): ov3b 3.0B eager, ov095 0.95B eager, ovc095 0.95B compiled,
#                 each beside hfsdp's default, FSDP2, Megatron-FSDP and the model alone; ovcorrect: gpu_correctness
#                 on the overlapped step (eager and compiled: bit-identical to the step in order, deterministic,
#                 the stream sanitizer)
#   two           2 GPUs: ZeRO-3 1x2, HSDP 2x1, HFSDP 2x1 of both 0.95B models, hfsdp and hfsdp+fused+clip vs FSDP2
# A phase that would not fit in what is left of BUDGET seconds is skipped, and says so; a failed phase does not stop
# the next. Full logs and JSON stay in OUT_DIR; the summary (bench/perf_summary.py) is printed last.
# Usage (repository root on the GPU machine): bash bench/perf_session.sh OUT_DIR [PHASES]
set -u
out=${1:?output directory}
phases=${2:-"env check floor3b h67 f67 o67full largest o67half fsdp2off67 two"}
BUDGET=${BUDGET:-420}
start=$(date +%s)
mkdir -p "$out"
: >"$out/status.txt"
if ls .whl/*.whl >/dev/null 2>&1; then  # megatron-core, for the GPT of the 2-GPU phase
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:packages/core/src:packages/ckpt/src:packages/cli/src
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

left() { echo $((BUDGET - ($(date +%s) - start))); }
# phase NAME ESTIMATE_S MAX_S COMMAND...: run unless fewer than ESTIMATE_S seconds are left; log to OUT/NAME.log
phase() {
  local name=$1 est=$2 max=$3 remaining limit t0 rc
  shift 3
  remaining=$(left)
  if [ "$remaining" -lt "$est" ]; then
    echo "SKIPPED $name (${remaining} s left of ${BUDGET}, needs about ${est})" | tee -a "$out/status.txt"
    return 0
  fi
  limit=$((remaining < max ? remaining : max))
  echo "=== $name (limit ${limit} s)"
  t0=$(date +%s)
  timeout --kill-after=15 "$limit" "$@" >"$out/$name.log" 2>&1
  rc=$?
  if [ $rc = 0 ]; then state=OK; else state="FAILED rc=$rc"; fi
  echo "$state $name $(($(date +%s) - t0)) s" | tee -a "$out/status.txt"
  grep -E "^(PASS|FAIL|kernel timing|measured|MFU denominator|!!!)" "$out/$name.log" | grep -v "^PASS" | head -20
  return 0
}

BENCH="torchrun --nproc-per-node 1 bench/bench_step.py --device cuda --model llama --vocab 32000 --seq-len 2048"
BENCH="$BENCH --dtype bf16 --build-on-device"
L3B="--layers 28 --hidden 3072 --ffn 8192 --heads 24 --kv-heads 8 --micro-batch-size 2"
L67="--layers 32 --hidden 4096 --ffn 11008 --heads 32 --micro-batch-size 1"
VARIANTS="hfsdp,hfsdp+fused,hfsdp+fused+clip,hfsdp+fused+clip+prestage"
DEFAULT="hfsdp+fused+clip+prestage"  # what hfsdp train runs on a GPU
L095="--layers 16 --hidden 2048 --ffn 5632 --heads 16 --micro-batch-size 4"
for name in $phases; do
  case $name in
    env)
      phase env 3 30 bash -c 'nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv;
        python3 -c "import torch, triton, transformers, sys; print(sys.version.split()[0], torch.__version__,
        triton.__version__, transformers.__version__, torch.cuda.device_count())"; head -3 /proc/meminfo; nproc' ;;
    check) phase check 30 120 python3 bench/perf_checks.py --out "$out/checks.json" ;;
    correct) phase correct 150 300 python3 bench/gpu_correctness.py "$out/correct" ;;
    default3b)
      phase default3b 120 240 $BENCH $L3B --steps 5 --warmup 2 --floor --engines "$DEFAULT,hfsdp,fsdp2,mfsdp,model" \
        --out "$out/default3b.json" ;;
    e095) phase e095 60 150 $BENCH $L095 --steps 8 --warmup 3 --engines "$DEFAULT,fsdp2,mfsdp,mfsdp2,model" \
        --out "$out/e095.json" ;;
    c095) phase c095 120 240 $BENCH $L095 --steps 8 --warmup 3 --compile --engines "$DEFAULT,fsdp2,mfsdp,model" \
        --out "$out/c095.json" ;;
    mfu3b)
      phase mfu3b 100 200 $BENCH $L3B --steps 5 --warmup 2 --compile --engines "$DEFAULT,model" --out "$out/mfu3b.json"
      phase mfu3bliger 100 200 $BENCH $L3B --steps 5 --warmup 2 --compile --liger --engines "$DEFAULT,model" \
        --out "$out/mfu3bliger.json" ;;
    mfu3bmb4)
      phase mfu3bmb4 100 200 $BENCH ${L3B/--micro-batch-size 2/--micro-batch-size 4} --steps 5 --warmup 2 --compile \
        --lr 3e-4 --engines "$DEFAULT,fsdp2,mfsdp,model" --out "$out/mfu3bmb4.json" ;;
    train3b|train095|train3bmb4|train095mb8)
      case $name in
        train3b) model=3.0b mb=2 gbs=4 ;;      # hfsdp train's default: 2 microbatches per step
        train095) model=0.95b mb=4 gbs=8 ;;
        train3bmb4) model=3.0b mb=4 gbs=4 ;;   # one microbatch of twice the sequences: the update over twice the work
        train095mb8) model=0.95b mb=8 gbs=8 ;;
      esac
      T="python3 -m hfsdp.cli train --model-config bench/configs/llama-$model.json --nproc 1 --device cuda --dtype bf16"
      T="$T --seq-len 2048 --micro-batch-size $mb --global-batch-size $gbs --log-every 1 --lr 3e-4"  # 3e-3 diverges
      phase "$name" 90 200 $T --compile --steps 8 --metrics "$out/$name.jsonl"
      case $name in train3b|train095)
        phase "$name-overlap" 90 200 $T --compile --overlap-step --steps 8 --metrics "$out/$name-overlap.jsonl" ;;
      esac
      phase "$name-eager" 40 120 $T --steps 4 --metrics "$out/$name-eager.jsonl" ;;
    prof3b)
      T="python3 -m hfsdp.cli train --model-config bench/configs/llama-3.0b.json --nproc 1 --device cuda --dtype bf16"
      T="$T --seq-len 2048 --micro-batch-size 2 --global-batch-size 4 --log-every 1 --lr 3e-4 --compile --steps 6"
      phase prof3b 90 200 $T --metrics "$out/prof3b.jsonl" --profile-dir "$out/prof3b" --profile-steps 5-6
      phase prof3b-gaps 5 60 python3 bench/trace_gaps.py "$out/prof3b/rank0-steps5-6.json.gz" --out "$out/prof3b-gaps.json"
      cat "$out/prof3b-gaps.log" ;;
    mfu3bm2)
      phase mfu3bm2 60 200 $BENCH $L3B --global-batch-size 4 --steps 5 --warmup 2 --compile --lr 3e-4 \
        --engines "$DEFAULT,fsdp2,model" --out "$out/mfu3bm2.json" ;;
    c095mb8)
      phase c095mb8 80 200 $BENCH ${L095/--micro-batch-size 4/--micro-batch-size 8} --steps 6 --warmup 2 --compile \
        --lr 3e-4 --engines "$DEFAULT,fsdp2,mfsdp,model" --out "$out/c095mb8.json" ;;
    c095m2)
      phase c095m2 50 200 $BENCH $L095 --global-batch-size 8 --steps 6 --warmup 2 --compile --lr 3e-4 \
        --engines "$DEFAULT,fsdp2,model" --out "$out/c095m2.json" ;;
    probe)
      phase probe095 30 120 python3 bench/overlap_probe.py --out "$out/probe095.json"
      phase probe3b 40 120 python3 bench/overlap_probe.py --layers 28 --hidden 3072 --ffn 8192 --heads 24 --kv-heads 8 \
        --batch 2 --out "$out/probe3b.json" ;;
    ligerdbg)
      phase ligerdbg-fsdp2 40 120 $BENCH $L095 --steps 3 --warmup 1 --compile --liger --engines fsdp2 \
        --out "$out/ligerdbg-fsdp2.json"
      phase ligerdbg-hfsdp 40 120 env CUDA_LAUNCH_BLOCKING=1 $BENCH $L095 --steps 3 --warmup 1 --compile --liger \
        --engines "$DEFAULT" --out "$out/ligerdbg-hfsdp.json" ;;
    ligerkeep)  # does Liger's compiled failure follow the regather for backward, or the prestaged step?
      phase ligerkeep 40 120 $BENCH $L095 --steps 3 --warmup 1 --compile --liger --engines "$DEFAULT+keep" \
        --out "$out/ligerkeep.json"
      phase ligerplain 40 120 $BENCH $L095 --steps 3 --warmup 1 --compile --liger --engines hfsdp \
        --out "$out/ligerplain.json" ;;
    ligernorms)  # Liger compiled with hfsdp, without the RMSNorm kernel inductor cannot analyse
      phase ligernorms 40 150 $BENCH $L095 --steps 3 --warmup 1 --compile --liger --liger-without rms_norm \
        --engines "$DEFAULT,fsdp2,model" --out "$out/ligernorms.json" ;;
    keep3b)
      phase keep3b 60 200 $BENCH ${L3B/--micro-batch-size 2/--micro-batch-size 4} --steps 5 --warmup 2 --compile \
        --lr 3e-4 --engines "$DEFAULT,$DEFAULT+keep,fsdp2,model" --out "$out/keep3b.json"
      phase keep3bm2 60 200 $BENCH $L3B --global-batch-size 4 --steps 5 --warmup 2 --compile --lr 3e-4 \
        --engines "$DEFAULT,$DEFAULT+keep,fsdp2" --out "$out/keep3bm2.json" ;;
    overlap)
      E="$DEFAULT,$DEFAULT+overlap,fsdp2,mfsdp,model"
      phase ov3b 60 200 $BENCH $L3B --steps 6 --warmup 2 --back-to-back --engines "$E" --out "$out/ov3b.json"
      phase ov095 45 150 $BENCH $L095 --steps 8 --warmup 3 --back-to-back --engines "$E" --out "$out/ov095.json"
      phase ovc095 60 200 $BENCH $L095 --steps 8 --warmup 3 --back-to-back --compile --engines "$E" \
        --out "$out/ovc095.json"
      phase ovcorrect 60 200 python3 bench/gpu_correctness.py "$out/ovcorrect" --styles eager,module \
        --options fused_clip_prestage,fused_clip_prestage_overlap ;;
    floor3b)
      phase floor3b 90 240 $BENCH $L3B --steps 6 --warmup 2 --floor --engines "$VARIANTS,fsdp2,model" \
        --out "$out/floor3b.json" ;;
    h67) phase h67 40 150 $BENCH $L67 --steps 4 --warmup 2 --engines hfsdp,hfsdp+fused+clip+prestage --out "$out/h67.json" ;;
    f67) phase f67 35 150 $BENCH $L67 --steps 4 --warmup 2 --engines fsdp2 --check-against "$out/h67.json" \
           --out "$out/f67.json" ;;
    o67full)
      phase o67full 60 150 $BENCH $L67 --steps 2 --warmup 1 --engines hfsdp --offload-fraction 1 \
        --check-against "$out/h67.json" --out "$out/o67full.json" ;;
    o67half)
      phase o67half 45 120 $BENCH $L67 --steps 3 --warmup 1 --engines hfsdp --offload-fraction 0.5 \
        --check-against "$out/h67.json" --out "$out/o67half.json" ;;
    largest)
      budget=$(( $(left) - 10 ))
      phase largest 90 300 python3 bench/largest_model.py --out "$out" --budget-s "$((budget < 290 ? budget : 290))" \
        --fsdp2-anyway --fsdp2-timeout-s 90 ;;
    fsdp2off67)
      phase fsdp2off67 90 150 $BENCH $L67 --steps 2 --warmup 1 --engines fsdp2 --offload \
        --check-against "$out/h67.json" --out "$out/fsdp2off67.json" ;;
    l13|fsdp2big)
      if [ "$name" = l13 ]; then shape="--layers 40"; engine="hfsdp --offload-fraction auto"
      else shape="--layers 36"; engine="fsdp2 --offload"; fi
      (while sleep 1; do echo "$(date +%s) $(grep -E 'MemAvailable' /proc/meminfo | tr -s ' ')"; done) >"$out/$name-mem.log" &
      sampler=$!
      phase "$name" 60 150 $BENCH $shape --hidden 5120 --ffn 13824 --heads 40 --micro-batch-size 1 --recompute \
        --steps 2 --warmup 1 --engines $engine --out "$out/$name.json"
      kill $sampler; dmesg 2>/dev/null | grep -iE "killed process|out of memory" | tail -3 >>"$out/$name.log" ;;
    two)
      gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
      if [ "${gpus:-0}" -ge 2 ] 2>/dev/null; then
        T="torchrun --nproc-per-node 2 bench/bench_step.py --device cuda --dtype bf16 --seq-len 2048 --vocab 32000"
        T="$T --micro-batch-size 4 --steps 8 --warmup 3 --layouts zero3:1x2,hsdp:2x1,hfsdp:2x1"
        T="$T --engines hfsdp,hfsdp+fused+clip,fsdp2"
        phase two-llama 150 300 $T --model llama --layers 16 --hidden 2048 --heads 16 --ffn 5632 --out "$out/two-llama.json"
        phase two-gpt 150 300 $T --model gpt --layers 16 --hidden 2048 --heads 16 --out "$out/two-gpt.json"
      else
        echo "SKIPPED two (one GPU here)" | tee -a "$out/status.txt"
      fi ;;
    *) echo "unknown phase $name" | tee -a "$out/status.txt" ;;
  esac
done
echo "=== summary ($(($(date +%s) - start)) s in all)"
python3 bench/perf_summary.py "$out"
# One archive of every log and JSON: a device call brings back only so many files.
(cd "$out" && tar -czf all.tgz --exclude=all.tgz -- *.log *.json *.jsonl summary.md 2>/dev/null)
