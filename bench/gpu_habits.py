"""The FSDP2 habits of issue 36 on a GPU (one process, NCCL, CUDA side streams), each against the plain model trained
the same way on the same GPU: the meta-device flow (`to_empty(device="cuda")`), frozen weights (fp32 and bf16
compute), torch's clip imported before sharding, FSDP2's accumulation flags, and a DCP resume (`dcp.save` and
`dcp.async_save`) taking the next step bit for bit.

Usage (repository root on the GPU machine): python3 bench/gpu_habits.py   (prints one line a check; exit 1 on a FAIL)
"""

from __future__ import annotations

import os
import sys

import torch
from torch.nn.utils import clip_grad_norm_  # bound before anything is sharded, as a script's first lines bind it

sys.path.insert(0, os.getcwd())
from tests.support.toy_models import global_batch, make_toy

STEPS, LR, CLIP = 3, 1e-2, 0.05
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU (gloo) run is this script's own test
FROZEN = ("inp.weight", "layers.0.up.weight", "layers.1.up.weight", "layers.2.up.weight")
results: list[tuple[str, bool, str]] = []


def check(name: str, ok: bool, detail: str) -> None:
    results.append((name, ok, detail))
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)


def toy(frozen: bool = False):
    model = make_toy().to(DEVICE)
    for name, param in model.named_parameters():
        param.requires_grad_(not (frozen and name in FROZEN))
    return model


def shard(model, mp=None):
    from hfsdp.core import LayoutConfig, build_meshes, fully_shard

    cfg = LayoutConfig(world_size=1, inner="optim_grads_params")
    return fully_shard(model, cfg, build_meshes(cfg, DEVICE), units=list(model.layers), mp=mp)


def train(model, clip=None, microbatches=1):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    norms = []
    for step in range(STEPS):
        x, y = (t.to(DEVICE) for t in global_batch(step))
        size = len(x) // microbatches
        for index in range(microbatches):
            if microbatches > 1:
                model.set_requires_gradient_sync(index == microbatches - 1)
            part = slice(index * size, (index + 1) * size)
            (model(x[part], y[part]) / microbatches).backward()
        if clip is not None:
            norms.append(clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        opt.zero_grad()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return norms


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.float().cpu() for k, v in model.state_dict().items()}


def max_rel(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)).item() for k in b)


def main() -> int:
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    # A CPU backend beside NCCL: DCP's async_save coordinates on it (torch refuses async_save without one).
    dist.init_process_group("cpu:gloo,cuda:nccl" if DEVICE == "cuda" else "gloo", rank=0, world_size=1)
    if DEVICE == "cuda":
        torch.cuda.set_device(0)

    plain = toy()
    ref_norms = train(plain, clip=CLIP)
    ref = weights(plain)

    with torch.device("meta"):
        meta = make_toy()
    meta = shard(meta)
    meta.to_empty(device=DEVICE)
    meta.load_state_dict(make_toy().state_dict())
    train(meta, clip=CLIP)
    err = max_rel(weights(meta), ref)
    check("meta flow: to_empty + load_state_dict trains like the plain model", err < 1e-5, f"max rel {err:.2e}")

    clipped = shard(toy())
    norms = train(clipped, clip=CLIP)
    err = max(abs(a - b) / b for a, b in zip(norms, ref_norms, strict=True))
    check("torch's clip_grad_norm_ imported before sharding: the plain model's norms", err < 1e-5, f"max rel {err:.2e}")

    accumulated = shard(toy())
    train(accumulated, clip=CLIP, microbatches=2)
    err = max_rel(weights(accumulated), ref)
    check("set_requires_gradient_sync with (loss / M): the plain model's weights", err < 1e-4, f"max rel {err:.2e}")

    plain_frozen = toy(frozen=True)
    train(plain_frozen)
    frozen = shard(toy(frozen=True))
    train(frozen)
    err = max_rel(weights(frozen), weights(plain_frozen))
    check("frozen weights, fp32: the plain model's weights", err < 1e-5, f"max rel {err:.2e}")

    from hfsdp.core import MixedPrecision

    bf16 = shard(toy(frozen=True), mp=MixedPrecision(param_dtype=torch.bfloat16))
    train(bf16)
    start, got, want = weights(toy(frozen=True)), weights(bf16), weights(plain_frozen)
    unchanged = all(torch.equal(got[n], start[n]) for n in FROZEN)
    trained = [n for n in want if n not in FROZEN]
    # AdamW's first updates are nearly sign-like, so bf16's noise flips single elements: compare the whole update.
    update = torch.cat([(got[n] - start[n]).flatten() for n in trained])
    fp32 = torch.cat([(want[n] - start[n]).flatten() for n in trained])
    cos = torch.nn.functional.cosine_similarity(update, fp32, dim=0).item()
    check("frozen weights, bf16 compute: frozen unchanged, the fp32 update", unchanged and cos > 0.9, f"cos {cos:.4f}")

    import tempfile

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def one_step(model, opt, step):
        x, y = (t.to(DEVICE) for t in global_batch(step))
        model(x, y).backward()
        opt.step()
        opt.zero_grad()

    for save in ("dcp.save", "dcp.async_save"):
        with tempfile.TemporaryDirectory() as path:
            saved = shard(toy(), mp=MixedPrecision(param_dtype=torch.bfloat16))
            opt = torch.optim.AdamW(saved.parameters(), lr=LR)
            one_step(saved, opt, 0)
            model_state, optim_state = get_state_dict(saved, opt)
            state = {"model": model_state, "optim": optim_state}
            if save == "dcp.save":
                dcp.save(state, checkpoint_id=path)
            else:
                dcp.async_save(state, checkpoint_id=path).result()
            one_step(saved, opt, 1)
            resumed = shard(make_toy(seed=7).to(DEVICE), mp=MixedPrecision(param_dtype=torch.bfloat16))
            resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=LR)
            model_state, optim_state = get_state_dict(resumed, resumed_opt)
            state = {"model": model_state, "optim": optim_state}
            dcp.load(state, checkpoint_id=path)
            set_state_dict(resumed, resumed_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            one_step(resumed, resumed_opt, 1)
            want, got = weights(saved), weights(resumed)
            same = all(torch.equal(want[k], got[k]) for k in want)
            check(f"DCP ({save}) resume: the next step bit for bit", same, f"max rel {max_rel(got, want):.2e}")

    dist.destroy_process_group()
    failed = [name for name, ok, _ in results if not ok]
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
