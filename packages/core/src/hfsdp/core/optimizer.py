"""Optimizers that step only this rank's piece of the fp32 main weights.

The update is elementwise, so stepping a flat piece computes exactly what
`torch.optim.AdamW` / `SGD` compute on the same elements of the unsharded model;
the arithmetic below follows torch's single-tensor implementations op for op.
After the step each group publishes its new weights (cast to the compute dtype
and all-gathered where parameters are replicated but the optimizer is sharded).
"""

from __future__ import annotations

import math

import torch

from hfsdp.core.flat_group import FlatParamGroup


class ShardedOptimizer:
    """Common state handling: one state dict of flat fp32 tensors per group."""

    state_names: tuple[str, ...] = ()

    def __init__(self, groups: list[FlatParamGroup], lr: float):
        self.groups = list(groups)
        self.lr = lr
        self.step_count = 0
        self.state = [{name: torch.zeros_like(g.main) for name in self.state_names} for g in self.groups]

    @torch.no_grad()
    def step(self) -> None:
        self.step_count += 1
        for group, state in zip(self.groups, self.state, strict=True):
            group.wait_for_publish()  # the last publish may still read `main` (a view of the shard in fp32)
            self._update(group.main, group.main_grad.float(), state)
            group.publish_main_weights()

    def _update(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def zero_grad(self) -> None:
        for group in self.groups:
            group.zero_grad()

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.state for t in s.values())


class ShardedAdamW(ShardedOptimizer):
    """AdamW with torch.optim.AdamW's hyper-parameters and arithmetic (decoupled weight decay)."""

    state_names = ("exp_avg", "exp_avg_sq")

    def __init__(self, groups, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        super().__init__(groups, lr)
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay

    def _update(self, param, grad, state) -> None:
        beta1, beta2 = self.betas
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        param.mul_(1 - self.lr * self.weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1**self.step_count
        bias_correction2 = 1 - beta2**self.step_count
        denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(self.eps)
        param.addcdiv_(exp_avg, denom, value=-self.lr / bias_correction1)


class ShardedSGD(ShardedOptimizer):
    """SGD with torch.optim.SGD's momentum and (coupled) weight decay."""

    def __init__(self, groups, lr=1e-2, momentum=0.0, weight_decay=0.0):
        self.state_names = ("momentum_buffer",) if momentum else ()
        super().__init__(groups, lr)
        self.momentum, self.weight_decay = momentum, weight_decay

    def _update(self, param, grad, state) -> None:
        if self.weight_decay:
            grad = grad.add(param, alpha=self.weight_decay)
        if self.momentum:
            buf = state["momentum_buffer"]
            if self.step_count == 1:
                buf.copy_(grad)
            else:
                buf.mul_(self.momentum).add_(grad)
            grad = buf
        param.add_(grad, alpha=-self.lr)
