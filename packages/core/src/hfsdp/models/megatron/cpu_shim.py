"""The CPU compatibility shim for megatron-core's CUDA-only calls. Applied only without a GPU.

megatron-core assumes CUDA in two places hfsdp's CPU runs reach:
- `torch.cuda.current_device()` to place buffers (rotary embeddings, MoE routing);
  without CUDA it is answered with "cpu";
- the CUDA RNG tracker (`get_cuda_rng_tracker().fork()` around dropout and
  initialisation); without CUDA the tracker keeps CPU generator states instead.
Everything else runs unchanged. With a GPU, `apply_cpu_shim` does nothing.

`define_missing_te_symbols` is the one fix that applies with a GPU too: megatron-core
0.16's MoE router refers to `te_general_gemm` even when Transformer Engine is not
installed (a NameError); it is defined as None there, which selects the torch path.
"""

from __future__ import annotations

import contextlib

import torch

_applied = False


class CpuRNGStatesTracker:
    """megatron-core's RNG tracker interface, keeping CPU generator states."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self) -> bool:
        return self._is_initialized

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"rng state {name} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise ValueError(f"rng state {name} is not added")
        outside = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outside)


def apply_cpu_shim() -> bool:
    """Patch megatron-core for CPU when CUDA is absent; return whether the shim is active."""
    global _applied
    if torch.cuda.is_available():
        return False
    if not _applied:
        from megatron.core.tensor_parallel import random as megatron_random

        torch.cuda.current_device = lambda: "cpu"
        megatron_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
        megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
        _applied = True
    return True


def define_missing_te_symbols() -> None:
    """Give megatron-core's MoE utilities the `None` fallbacks its own import forgot without TE."""
    from megatron.core.transformer.moe import moe_utils

    if not getattr(moe_utils, "HAVE_TE", True) and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def seed_megatron(seed: int) -> None:
    """Seed megatron-core's tracked RNG states (model-parallel, expert-parallel, data-parallel)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as megatron_random

    torch.manual_seed(seed)
    if not apply_cpu_shim():
        megatron_random.model_parallel_cuda_manual_seed(seed)
        return
    tracker = megatron_random._CUDA_RNG_STATE_TRACKER
    tracker.reset()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    tracker.add(megatron_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718)
    tracker.add(megatron_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank)
