"""Train your own model with hfsdp's engine: a complete, runnable example.

A transformers Llama here, but any nn.Module works the same way, with FSDP2's habits: name its units
(its transformer layers), shard it in place with `fully_shard`, build any `torch.optim` optimizer over
`model.parameters()` (each rank's fp32 pieces), clip with `model.clip_grad_norm_`, and save and load
with `hfsdp.ckpt` (any layout). Launch one process per rank with torchrun:

    torchrun --nproc-per-node 4 examples/train_fully_shard.py --instances 2 --steps 20 --save /tmp/ck
    torchrun --nproc-per-node 2 examples/train_fully_shard.py --steps 30 --load /tmp/ck   # any other layout

Every rank prints nothing but rank 0: one line per step, `step K loss L`.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from hfsdp.ckpt import load_checkpoint, save_checkpoint, save_conflict
from hfsdp.core import LayoutConfig, MixedPrecision, build_meshes, fully_shard
from hfsdp.recipes.data import SyntheticTokens, microbatch
from hfsdp.recipes.lr_schedule import Schedule, scheduler

VOCAB, SEQ, MICROBATCHES, PER_RANK = 128, 32, 2, 2


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--instances", type=int, default=1, help="optimizer instances: >1 gives HFSDP")
    p.add_argument("--steps", type=int, default=20, help="total steps of the run (a resume continues to it)")
    p.add_argument("--save", default=None, help="checkpoint root to save into at the end")
    p.add_argument("--load", default=None, help="checkpoint (root or step directory) to resume from")
    args = p.parse_args()
    if args.save and (taken := save_conflict(args.save, args.steps)):  # check before training, not after it
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: --save {args.save} already holds {taken.name}, which this run would save; a save never "
                  "overwrites. Choose another --save, remove it, or resume with --load.", file=sys.stderr)  # fmt: skip
        sys.exit(2)

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")  # torchrun set RANK, WORLD_SIZE, MASTER_ADDR, ...
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    # 1. The layout: ZeRO-3 inside an instance; with instances > 1 the optimizer is sharded across them too.
    outer = "optim" if args.instances > 1 else "no_shard"
    cfg = LayoutConfig(world_size=world, inner="optim_grads_params", outer=outer, instances=args.instances)

    # 2. Your model, the same on every rank (same seed), sharded by its decoder layers.
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(device)
    mp = MixedPrecision(param_dtype=torch.bfloat16 if cuda else None, reduce_dtype=torch.float32)
    # In place, as FSDP2's: the same LlamaForCausalLM (generate, config, ...), its parameters now this rank's pieces.
    meshes = build_meshes(cfg, device.type)
    fully_shard(model, cfg, meshes, units=model.model.layers, mp=mp, reshard_root_after_forward=True)

    # 3. Any torch.optim optimizer over model.parameters(), any schedule.
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, fused=True)
    start = int(load_checkpoint(args.load, model, opt)["step"]) if args.load else 0  # any layout: reshards
    lr = scheduler(opt, Schedule(3e-3, min_lr=3e-4, warmup_iters=4, decay_iters=args.steps, style="cosine"), start)

    # 4. Train. Each step's global batch is the same on every rank; each rank takes its own microbatches of it.
    data = SyntheticTokens(VOCAB, SEQ)
    for step in range(start, args.steps):
        batch = data.global_batch(step, PER_RANK * MICROBATCHES * cfg.dp)
        total = torch.zeros((), device=device)
        for index in range(MICROBATCHES):
            model.set_microbatch(index, MICROBATCHES)  # gradients are averaged over microbatches and ranks
            tokens, labels = (t.to(device) for t in microbatch(batch, index, MICROBATCHES, rank, cfg.dp))
            logits = model(input_ids=tokens).logits
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
            loss.backward()
            total += loss.detach()
        model.clip_grad_norm_(1.0)  # the global norm over every rank's pieces
        opt.step()  # steps the main params; hfsdp then publishes the new weights by itself
        opt.zero_grad()
        lr.step()
        dist.all_reduce(total)
        if rank == 0:
            print(f"step {step + 1} loss {total.item() / (MICROBATCHES * cfg.dp)!r}", flush=True)

    # 5. Save: every rank writes its own file; `hfsdp ckpt export DIR OUT` makes it a Hugging Face model.
    if args.save:
        record = {"format": "transformers", "config": config.to_dict()}
        save_checkpoint(args.save, model, opt, step=args.steps, model_record=record)
    # torch's gloo keeps finished collectives in reference cycles, and the model's meshes hold its process groups;
    # freed only at interpreter exit, either can abort the process ("terminate called without an active exception":
    # about once in five runs before, once in a full test suite under load since), so free them while the default
    # process group lives.
    del model, opt, lr, meshes
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
