"""What `FusedAdamW(capturable=True)` keeps on the host, so that its step reads nothing there.

A CUDA graph replays kernels, not Python: a step that a graph can capture must take its per-step scalars (AdamW's
bias corrections) from tensors on the device, advance its step counts there, and read every tensor at the address it
had when captured. This module holds the host side of that contract:

- each piece's step count as the host last knew it (`counts`). The step tensors live on the device and are never
  read during a step, but pieces may share one kernel run only where their counts are equal, and the host must know
  that without reading them: counts are set at the first step and at `load_state_dict`, and advanced by eager steps;
- the constant rows `device_scalars` needs (a float lr, betas, eps, weight decay), one device tensor per distinct set,
  made eagerly: a graph being captured can only reuse one (so the warm-up step torch asks for makes them);
- the rules: steps and a tensor lr on the parameters' device, nothing offloaded, and every group's gradient buffer
  kept at one address from step to step (`GradBuffer.keep_storage`).

Replays advance the device's counts, not the host's: the host's then lag by the same number for every piece the graph
stepped, so equal host counts still mean equal device counts. A piece the graph did not step (it had no gradient at
capture) lags less, and an eager step after the replays could run it with another piece's scalars: capture a step in
which every parameter that will ever be stepped has its gradient (hfsdp's engine gives every piece one).
"""

from __future__ import annotations

import torch

from hfsdp.core.buffers.main_params import piece_of
from hfsdp.core.kernels.adamw_kernel import device_scalars, scalar_constants

#: Distinct constant sets kept before starting over (a float lr a scheduler changes every step makes a new one).
MAX_CONSTANT_SETS = 64


class CapturableSteps:
    """The host's bookkeeping of one capturable optimizer."""

    def __init__(self):
        self.counts: dict[int, int] = {}  # id(param) -> its step count as the host knows it
        self._constants: dict[tuple, torch.Tensor] = {}  # (device, rows) -> their `scalar_constants` tensor

    def scalars(self, steps: list[torch.Tensor], options: list[dict]) -> torch.Tensor:
        """One row of AdamW's per-step scalars per run (`device_scalars`): `steps` the runs' step tensors before
        this step, `options` their parameter groups. Computed on the device; nothing read on the host."""
        device = steps[0].device
        if any(s.device != device for s in steps):
            raise ValueError(
                "FusedAdamW(capturable=True) steps parameters on one device; these are on "
                f"{sorted({str(s.device) for s in steps})}."
            )
        lrs, rows = [], []
        for group in options:
            lr = group["lr"]
            tensor = isinstance(lr, torch.Tensor)
            if tensor and lr.device != device:
                raise ValueError(
                    f"FusedAdamW(capturable=True): a tensor lr must be on the parameters' device ({device}), this one "
                    f"is on {lr.device}."
                )
            beta1, beta2 = (float(b) for b in group["betas"])
            lrs.append(lr if tensor else None)
            rows.append((0.0 if tensor else float(lr), beta1, beta2, float(group["eps"]), float(group["weight_decay"])))
        return device_scalars(steps, lrs, self._constants_for(rows, device))

    def _constants_for(self, rows: list[tuple], device: torch.device) -> torch.Tensor:
        key = (str(device), tuple(rows))
        found = self._constants.get(key)
        if found is None:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "FusedAdamW(capturable=True): lr, betas, eps or weight_decay changed since the last eager step, "
                    "and the step is being captured into a CUDA graph; step once eagerly (the warm-up torch's docs "
                    "ask for) with the values the graph should bake in, then capture."
                )
            if len(self._constants) > MAX_CONSTANT_SETS:
                self._constants.clear()
            found = self._constants[key] = scalar_constants(list(rows), device)
        return found

    def stepped(self, params) -> None:
        """Eager steps advance the counts the host knows (a replay advances only the device's)."""
        for param in params:
            if id(param) in self.counts:
                self.counts[id(param)] += 1

    def after_load(self, param_groups: list[dict], state, lrs: list, old_steps: dict) -> None:
        """After `load_state_dict`: a tensor lr (`lrs`, as they were before the load) and each device step tensor
        (`old_steps`, by id of the parameter) stay the same tensors, now holding the loaded values, so a graph
        captured before the load reads them; and each piece's count is noted on the host (loading may read the host;
        a step may not)."""
        for group, lr in zip(param_groups, lrs, strict=True):
            if isinstance(lr, torch.Tensor) and group["lr"] is not lr:
                lr.fill_(group["lr"].to(lr.device) if isinstance(group["lr"], torch.Tensor) else float(group["lr"]))
                group["lr"] = lr
        self.counts.clear()
        for param, entry in state.items():
            step = entry.get("step")
            if step is None:
                continue
            step = device_step(step, param.device)
            old = old_steps.get(id(param))
            if old is not None and old is not step and old.device == step.device and old.dtype == step.dtype:
                old.copy_(step)
                step = old
            entry["step"] = step
            self.counts[id(param)] = int(step.item())


def device_step(step, device) -> torch.Tensor:
    """A step count as a capturable optimizer keeps it: a 0-dim fp32 tensor on `device` (`step` itself when it is one
    already; otherwise a copy, never a read on the host)."""
    if isinstance(step, torch.Tensor):
        if step.device == device and step.dtype == torch.float32 and step.dim() == 0:
            return step
        return step.to(device=device, dtype=torch.float32).reshape(())
    return torch.tensor(float(step or 0.0), dtype=torch.float32, device=device)


def refuse_offloaded(group) -> None:
    if group.offload:
        raise ValueError(
            "FusedAdamW(capturable=True) cannot step a group offloaded to host memory (offload=...): its step runs "
            "on the CPU; use capturable=False with offload."
        )


def prepare_params(param_groups) -> None:
    """At construction: refuse offloaded groups, and keep every other group's gradient buffer at one address from
    step to step, where a captured step reads it."""
    for options in param_groups:
        for param in options["params"]:
            piece = piece_of(param)
            if piece is not None:
                refuse_offloaded(piece.group)
                piece.group.grads.keep_storage = True
