#!/usr/bin/env bash
# hfsdp train end to end on one GPU (called by gpu_session.sh's e2e phase): a transformers Llama trained in bf16
# with the optimizer offloaded, saved, resumed on the same layout (losses must be bit-identical), exported to
# Hugging Face and loaded back by transformers.
set -u
out=${1:?output directory}
w=/tmp/hfsdp-e2e
rm -rf $w && mkdir -p $w && rm -f "$out/whole.jsonl" "$out/resumed.jsonl"
python3 - $w <<'PY'
import sys
from transformers import LlamaConfig, LlamaForCausalLM
LlamaForCausalLM(LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)).save_pretrained(f"{sys.argv[1]}/hf")
PY
T="python3 -m hfsdp.cli train --model-config $w/hf/config.json --nproc 1 --device cuda --dtype bf16 --offload optim
   --seq-len 512 --global-batch-size 8 --micro-batch-size 4 --lr 1e-3 --lr-warmup-iters 2 --lr-decay-style cosine
   --lr-decay-iters 6 --eval-interval 3 --steps 6"
python3 -m hfsdp.cli ckpt import $w/hf $w/imported --world-size 1 >"$out/e2e.log" 2>&1
$T --load $w/imported --metrics $out/whole.jsonl >>"$out/e2e.log" 2>&1
$T --load $w/imported --steps 3 --save $w/ck >>"$out/e2e.log" 2>&1
$T --load $w/ck --metrics $out/resumed.jsonl >>"$out/e2e.log" 2>&1
python3 -m hfsdp.cli ckpt export $w/ck $w/out --format hf --dtype bf16 >>"$out/e2e.log" 2>&1
python3 - $out $w <<'PY'
import json, sys
from transformers import AutoModelForCausalLM
out, w = sys.argv[1:]
whole = [json.loads(l) for l in open(f"{out}/whole.jsonl")]
resumed = [json.loads(l) for l in open(f"{out}/resumed.jsonl")]
for r in resumed:
    u = whole[r["step"] - 1]
    print(f"step {r['step']}: uninterrupted {u['loss']!r} resumed {r['loss']!r} equal={u['loss'] == r['loss']} "
          f"lr {r['lr']:.6g}" + (f" eval {r['eval_loss']!r} vs {u.get('eval_loss')!r}" if "eval_loss" in r else ""))
model, info = AutoModelForCausalLM.from_pretrained(f"{w}/out", output_loading_info=True)
print("export loads in transformers:", type(model).__name__, {k: len(v) for k, v in info.items()})
PY
tail -4 "$out/e2e.log"
