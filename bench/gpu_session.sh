#!/usr/bin/env bash
# One device call: install the carried megatron-core wheel, then run the benchmarks PHASES names
# (space-separated; default: all) into OUT_DIR. Each bench prints its tables; full JSON and logs stay in OUT_DIR.
#   optimizer  bench_optimizer.py: the AdamW step alone (torch fused vs the removed flat AdamW)
#   gpt1       megatron-core GPT 0.94B, 1 GPU: hfsdp vs FSDP2 (and the model alone: the floor), profiled
#   llama1     transformers Llama 0.89B, 1 GPU, eager: hfsdp vs FSDP2, profiled
#   compile1   the Llama with torch.compile per decoder layer, 1 GPU
#   gpt2       the GPT on 2 GPUs: ZeRO-3 1x2, HSDP 2x1, HFSDP 2x1
#   llama2     the Llama on 2 GPUs: ZeRO-3 1x2, HSDP 2x1, HFSDP 2x1
#   offload1   the Llama with the optimizer in host memory, 1 GPU: hfsdp offload vs FSDP2 CPUOffloadPolicy
#   memgpt     per-rank peak memory of the GPT in every 2- and 8-rank layout, one process simulating rank 0 on
#              the fake process group (--simulate-world: real allocations, no communication)
#   memllama   the same for the Llama
#   plan       bench/plan_check.py: hfsdp plan's peak memory (14 simulated layouts of both models) and 1-GPU step time
#              against measurement; a short table last, logs and JSON in OUT_DIR/plan
#   e2e        hfsdp train on the GPU: a Hugging Face model (bf16, --offload optim, schedule, eval) saved at step 3,
#              resumed to step 6 and compared with the uninterrupted run; then exported and loaded by transformers
#   resilience bench_resilience.py: the training stall of a save, sync vs --async-save (Llama 0.9B and 3B), and
#              the time to recover from a killed rank (detect, restart, load); logs and results.json in OUT/resilience
# EXTRA: what gpt1 and llama1 add to the timing (default: --profile --memory-trace).
# Usage (repository root on the GPU machine): bash bench/gpu_session.sh OUT_DIR [PHASES]
set -u
out=${1:?output directory}
phases=${2:-"optimizer gpt1 llama1 compile1 gpt2 llama2 offload1"}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:packages/core/src:packages/ckpt/src:packages/cli/src
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv >"$out/gpu.txt"
B="--dtype bf16 --seq-len 2048 --micro-batch-size 4 --vocab 32000 --steps 12 --warmup 3"
GPT="--model gpt --layers 16 --hidden 2048 --heads 16"
LLAMA="--model llama --layers 16 --hidden 2048 --heads 16 --ffn 5632"
show() { grep -v "Warning\|warn(\|DEPRECATED" "$1" | grep -A8 "## Step time\|## Loss" | head -24; }
for phase in $phases; do
  echo "=== $phase"
  case $phase in
    optimizer) timeout 120 python3 bench/bench_optimizer.py --hidden 2048 --layers 16 | tee "$out/optimizer.log" ;;
    gpt1) timeout 300 torchrun --nproc-per-node 1 bench/bench_step.py --device cuda $B $GPT --layouts zero3:1x1 \
            --engines hfsdp,fsdp2,model ${EXTRA---profile --memory-trace} --out "$out/gpt1.json" >"$out/gpt1.log" 2>&1; show "$out/gpt1.log" ;;
    llama1) timeout 300 torchrun --nproc-per-node 1 bench/bench_step.py --device cuda $B $LLAMA --layouts zero3:1x1 \
            --engines hfsdp,fsdp2,model ${EXTRA---profile --memory-trace} --out "$out/llama1.json" >"$out/llama1.log" 2>&1; show "$out/llama1.log" ;;
    compile1) timeout 420 torchrun --nproc-per-node 1 bench/bench_step.py --device cuda $B $LLAMA --compile \
            --layouts zero3:1x1 --engines hfsdp,fsdp2,model --out "$out/compile1.json" >"$out/compile1.log" 2>&1
            show "$out/compile1.log" ;;
    gpt2) timeout 420 torchrun --nproc-per-node 2 bench/bench_step.py --device cuda $B $GPT \
            --layouts zero3:1x2,hsdp:2x1,hfsdp:2x1 --engines hfsdp,fsdp2 --out "$out/gpt2.json" >"$out/gpt2.log" 2>&1
          show "$out/gpt2.log" ;;
    llama2) timeout 420 torchrun --nproc-per-node 2 bench/bench_step.py --device cuda $B $LLAMA \
            --layouts zero3:1x2,hsdp:2x1,hfsdp:2x1 --engines hfsdp,fsdp2 --out "$out/llama2.json" >"$out/llama2.log" 2>&1
          show "$out/llama2.log" ;;
    offload1) timeout 300 torchrun --nproc-per-node 1 bench/bench_step.py --device cuda $LLAMA --dtype bf16 \
            --seq-len 2048 --micro-batch-size 4 --vocab 32000 --steps 4 --warmup 1 --offload --layouts zero3:1x1 \
            --engines hfsdp,fsdp2 --out "$out/offload1.json" >"$out/offload1.log" 2>&1; show "$out/offload1.log" ;;
    memgpt|memllama)
          model=$([ "$phase" = memgpt ] && echo "$GPT" || echo "$LLAMA")
          for world in 2 8; do
            layouts=$([ $world = 2 ] && echo "zero3:1x2,zero2:1x2,hsdp:2x1,hfsdp:2x1" \
              || echo "zero3:1x8,zero2:1x8,hsdp:2x4,hfsdp:2x4,hsdp:4x2,hfsdp:4x2")
            timeout 420 python3 bench/bench_step.py --device cuda --simulate-world $world $B $model --steps 2 \
              --warmup 1 --layouts $layouts --engines hfsdp,fsdp2 --out "$out/$phase-$world.json" \
              >"$out/$phase-$world.log" 2>&1
            grep "^| hfsdp\|^| fsdp2" "$out/$phase-$world.log"
          done ;;
    plan) timeout 560 python3 bench/plan_check.py "$out/plan" | tee "$out/plan.log" ;;
    e2e) bash bench/gpu_e2e.sh "$out" ;;
    resilience) timeout 570 python3 bench/bench_resilience.py "$out/resilience" >"$out/resilience.log" 2>&1
          tail -14 "$out/resilience.log" ;;
  esac
done
