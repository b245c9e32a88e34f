"""Whether the GPUs a run trains on can multiply in fp8: a pre-launch check of `--fp8-format`.

FP8 tensor cores (what `torch._scaled_mm` runs on) start at compute capability 8.9 (Ada; Hopper is 9.0, Blackwell
10.0): an A100 (8.0) would fail inside every rank, after minutes of setup, with a kernel error that names no flag.
The decision is `fp8_refusal`, a pure function of the capability, so it is tested on a CPU; `problems` asks torch
for the GPUs this machine's ranks use.
"""

from __future__ import annotations

#: The first compute capability with fp8 tensor cores.
FP8_CAPABILITY = (8, 9)


def fp8_refusal(capability: tuple[int, int], gpu: str, said: str, name: str = "--fp8-format") -> str | None:
    """The one-paragraph refusal of fp8 on `gpu`, or None when it has fp8 tensor cores. `said` is the setting as
    the user gave it ("--fp8-format 'hybrid'"), `name` its spelling alone (the flag or the file's key)."""
    if tuple(capability) >= FP8_CAPABILITY:
        return None
    major, minor = capability
    need = ".".join(map(str, FP8_CAPABILITY))
    return (
        f"{said} needs fp8 tensor cores, which GPUs have from compute capability {need} (Ada, Hopper, Blackwell), "
        f"but this machine's {gpu} has {major}.{minor}; train without fp8 on it (drop {name}), or on a GPU "
        "of capability 8.9 or more (L4, L40S, H100, H200, B200)."
    )


def problems(said: str, name: str, local_ranks: int) -> list[str]:
    """The refusal for the first GPU of the `local_ranks` this machine's ranks use that cannot run fp8 (one: a
    machine's GPUs are usually alike, and one is enough to stop the run)."""
    import torch

    for index in range(min(local_ranks, torch.cuda.device_count())):
        wrong = fp8_refusal(torch.cuda.get_device_capability(index), torch.cuda.get_device_name(index), said, name)
        if wrong is not None:
            return [wrong]
    return []
