"""How much of the optimizer step can one GPU hide behind the model's compute?

On one GPU the engine's cost over the model is, at its bandwidth floor, mostly AdamW: a memory-bound pass
over every parameter (30 bytes per element). Overlapping it with compute is the one way to go below that
floor. This probe measures what such an overlap could win, before any engine is built around it:

- `compute`: the model's forward (or forward and backward) alone, bf16, on the default stream;
- `adamw`: FusedAdamW's kernel over the model's parameter count in fp32 (one run per decoder layer and one
  for the root, as the engine steps them), alone;
- `together`: both started at once, the kernels on a side stream;
- `pipelined`: the realistic schedule for the next forward: each layer's forward waits for its own
  layer's step (an event per run), the root's first, as the next forward needs them.

hidden = (compute + adamw - together) / adamw: 1 means the step is free, 0 that the streams ran in turn.
Timed with CUDA events, the median of `--iters` repetitions after two warm-ups. GPU only.

Usage: python3 bench/overlap_probe.py --out OUT.json [--layers 16 --hidden 2048 --ffn 5632 --heads 16 --batch 4]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def _model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads or args.heads,
        vocab_size=args.vocab,
        max_position_embeddings=args.seq,
    )
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    return model


def _runs(model) -> list[int]:
    """Elements per optimizer run, in the order the next forward needs them: the root, then each layer."""
    layers = [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    return [sum(p.numel() for p in model.parameters()) - sum(layers), *layers]


class _Adam:
    """Flat fp32 state for `runs` elements and one `adamw_run` per run, each followed by an event."""

    def __init__(self, runs: list[int]):
        from hfsdp.core.kernels.adamw_kernel import AdamWScalars

        n = sum(runs)
        self.runs = runs
        self.param, self.grad, self.m, self.v = (torch.randn(n, device="cuda") * 0.01 for _ in range(4))
        self.v.abs_()
        self.out = torch.empty(n, device="cuda", dtype=torch.bfloat16)
        self.coef = torch.ones(1, device="cuda")
        self.scalars = AdamWScalars.of(1e-4, 0.9, 0.95, 1e-8, 0.1, 10)

    def step(self) -> list[torch.cuda.Event]:
        from hfsdp.core.kernels.adamw_kernel import adamw_run

        events, lo = [], 0
        for size in self.runs:
            hi = lo + size
            adamw_run(self.param[lo:hi], self.grad[lo:hi], self.m[lo:hi], self.v[lo:hi], self.scalars, self.coef,
                      self.out[lo:hi], "triton")  # fmt: skip
            event = torch.cuda.Event()
            event.record()
            events.append(event)
            lo = hi
        return events


def _timed(fn, iters: int) -> float:
    """Median milliseconds of `fn()` between two events on the default stream (two warm-ups first)."""
    times = []
    for i in range(iters + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    model = _model(args)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda")
    adam = _Adam(_runs(model))
    side = torch.cuda.Stream()
    waits: list[torch.cuda.Event] = []

    def wait_for_own_step(index: int):
        def hook(_module, _args) -> None:  # layer i's forward waits for run i + 1 (run 0: the root)
            if waits:
                torch.cuda.current_stream().wait_event(waits[index + 1])

        return hook

    for index, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(wait_for_own_step(index))

    def forward():
        return model(input_ids=tokens, use_cache=False).logits.float().logsumexp(-1).mean()

    def forward_backward():
        forward().backward()
        model.zero_grad(set_to_none=True)

    def with_adam(compute, pipelined: bool):
        def run():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                events = adam.step()
            if pipelined:
                waits[:] = events
                torch.cuda.current_stream().wait_event(events[0])  # the root's step before the embedding
            compute()
            waits.clear()
            torch.cuda.current_stream().wait_stream(side)

        return run

    result = {"shape": vars(args), "elements": sum(adam.runs)}
    result["adamw_ms"] = _timed(adam.step, args.iters)
    for name, compute in (("forward", lambda: forward()), ("forward_backward", forward_backward)):
        alone = _timed(compute, args.iters)
        row = {"compute_ms": alone}
        for mode in ("together", "pipelined"):
            both = _timed(with_adam(compute, mode == "pipelined"), args.iters)
            row[f"{mode}_ms"] = both
            row[f"{mode}_hidden"] = (alone + result["adamw_ms"] - both) / result["adamw_ms"]
        result[name] = row
        modes = ", ".join(
            f"{m} {row[m + '_ms']:.2f} ms (hidden {row[m + '_hidden']:.0%})" for m in ("together", "pipelined")
        )
        print(f"{name}: compute {alone:.2f} ms, adamw {result['adamw_ms']:.2f} ms, {modes}")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
