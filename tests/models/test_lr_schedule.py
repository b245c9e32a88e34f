"""Megatron's learning-rate schedule as a LambdaLR: the rates of every step, and a resume's."""

from __future__ import annotations

import math

import pytest
import torch

from hfsdp.recipes.lr_schedule import Schedule, scheduler


def megatron_lr(n: int, lr: float, min_lr: float, warmup: int, decay: int, style: str) -> float:
    """Megatron's OptimizerParamScheduler.get_lr for step n (counted from 1), written out again."""
    if warmup > 0 and n <= warmup:
        return lr * n / warmup
    if style == "constant":
        return lr
    if n > decay:
        return min_lr
    ratio = (n - warmup) / (decay - warmup)
    coeff = 1 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1)
    return min_lr + coeff * (lr - min_lr)


def _rates(opt, schedule, steps):
    rates = []
    for _ in range(steps):
        rates.append([g["lr"] for g in opt.param_groups])
        opt.step()
        schedule.step()
    return rates


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup", [0, 3])
def test_each_step_gets_megatrons_rate(style, warmup):
    """Step n of an optimizer driven by the LambdaLR runs at Megatron's rate for step n, in every group, through
    warmup, decay and after the decay's end."""
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))]
    opt = torch.optim.SGD([{"params": params[:1]}, {"params": params[1:], "lr": 5.0}], lr=1.0)
    schedule = Schedule(lr=2e-3, min_lr=2e-4, warmup_iters=warmup, decay_iters=10, style=style)
    rates = _rates(opt, scheduler(opt, schedule), 14)
    for n, step_rates in enumerate(rates, start=1):
        expected = megatron_lr(n, 2e-3, 2e-4, warmup, 10, style)
        assert step_rates == pytest.approx([expected, expected], rel=1e-12, abs=1e-15), n


def test_a_resumed_schedule_continues_where_it_stopped():
    """A scheduler built after 5 steps gives steps 6.. the rates an uninterrupted one gives them."""
    schedule = Schedule(lr=1e-3, min_lr=1e-5, warmup_iters=2, decay_iters=12, style="cosine")
    whole = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=7.0)
    uninterrupted = _rates(whole, scheduler(whole, schedule), 12)
    resumed_opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=7.0)
    resumed = _rates(resumed_opt, scheduler(resumed_opt, schedule, start_step=5), 7)
    assert resumed == uninterrupted[5:]


def test_an_unknown_style_is_refused():
    """A decay style outside constant, linear, cosine is a ValueError naming it."""
    with pytest.raises(ValueError, match="wsd"):
        Schedule(lr=1.0, style="wsd")
