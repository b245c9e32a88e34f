"""The runs `gpu_correctness.py` compares: one small transformers Llama trained for a few steps by a plain
single-process reference, by FSDP2 and by hfsdp, each way of compiling, each engine option.

Every engine starts from the same fp32 weights (built on the CPU from one seed), sees the same samples in the
same microbatches and computes in bf16 from fp32 main weights, with fp32 gradient reductions, torch's fused
AdamW (or hfsdp's FusedAdamW, on the reference too) and a global-norm clip. The reference is that recipe
written out in plain PyTorch: a bf16 copy of the model computes, fp32 gradients accumulate outside it, the
optimizer steps fp32 masters that are cast back after each step. It is what hfsdp does on one rank, so the
two agree to the rounding of the clip's norm (summed in another order); FSDP2 is the second witness.

A case is (engine, compile style, option); `run_case` returns its per-step losses (the mean over the global
batch), a digest of its final fp32 weights (bit-identity across runs and processes) and the weights
themselves on rank 0 (on the device with one rank), for the worker to compare across engines.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

SEED = 1234
#: How each style compiles the decoder layers (or, for "model", the whole model); "eager" compiles nothing.
STYLES = ("eager", "module", "fullgraph", "wrapper", "forward", "cli", "model")
#: Engine options: "offload" (fp32 state in host memory), "fused" (FusedAdamW, clip before it), "fused_clip_prestage"
#: (FusedAdamW clipping inside its step and writing the next forward's gather input), "fused_clip_prestage_overlap"
#: (and its step on a side stream, overlapping the next forward), "recompute"; and Megatron's precision-aware
#: optimizer through FusedAdamW: `_bf16m` / `_fp8m` moments, `_bf16g` gradients reduced and read in bf16 (its
#: reference steps the same FusedAdamW on gradients rounded to bf16); fp8 compute (issue 39): `fp8t` the units'
#: Linear layers in fp8, hybrid tensorwise, gathered in fp8 (`fp8_param_gather`), `fp8r` e4m3 rowwise, and
#: `fp8t_<optimizer option>` fp8t with that optimizer; their reference converts the same layers. "comms" and every
#: fp8t case build the engine under `single_rank_collectives()`: on one GPU (where no axis has a second rank) the
#: gathers and reductions a larger mesh runs are then issued as copies, on the same streams at the same points, so
#: their stream ordering is checked there too (above all the fp8 gather: quantize after the step, then gather).
#: `_rem`: FusedAdamW(store_param_remainders=True), the fp32 masters kept as the bf16 weights plus a 16-bit
#: remainder (under `single_rank_collectives()` too: the gather then reads the kept bf16 shard, no cast, or the fp8
#: weights quantized from it with `fp8t_`); its
#: reference steps fp32 masters and rounds them to bf16 as the split does (ties away from zero).
OPTIONS = (
    "",
    "offload",
    "fused",
    "fused_clip_prestage",
    "fused_clip_prestage_overlap",
    "recompute",
    "fused_clip_prestage_bf16m_bf16g",
    "fused_clip_prestage_fp8m_bf16g",
    "fp8t",
    "fp8r",
    "fp8t_fused_clip_prestage_overlap",
    "fp8t_fused_clip_prestage",
    "comms",
    "fused_clip_prestage_rem",
    "fp8t_fused_clip_prestage_rem",
)
FP8_OPTIONS = {"fp8t": ("hybrid", "tensorwise"), "fp8r": ("e4m3", "rowwise")}


def fp8_of(option: str) -> str:
    """The fp8 recipe an option names ("fp8t", "fp8r"; "" for none)."""
    head = option.split("_", 1)[0]
    return head if head in FP8_OPTIONS else ""


def optimizer_of(option: str) -> str:
    """An option without its fp8 recipe: what it says of the optimizer (or offload, recompute, comms)."""
    fp8 = fp8_of(option)
    return option.removeprefix(fp8).removeprefix("_") if fp8 else option


def plans_single_rank_collectives(option: str) -> bool:
    """Whether hfsdp is built under `single_rank_collectives()` (see OPTIONS)."""
    return option == "comms" or fp8_of(option) == "fp8t" or keeps_remainders(option)


def convert_fp8(model, option: str):
    """Convert the decoder layers' Linear layers to fp8 as `option` says (nothing for other options); before any
    compile. Returns whether the weights may be gathered in fp8."""
    if not fp8_of(option):
        return False
    from hfsdp.core import Float8Config, convert_to_float8

    fmt, recipe = FP8_OPTIONS[fp8_of(option)]
    convert_to_float8(model, Float8Config(fmt, recipe), units=list(model.model.layers), min_size=0)
    return recipe == "tensorwise"


PRECISION_SUFFIXES = ("_bf16m_bf16g", "_fp8m_bf16g")


def precision_of(option: str) -> str:
    """The precision-aware suffix of an option ("" for fp32 state and gradients)."""
    return next((s for s in PRECISION_SUFFIXES if option.endswith(s)), "")


def keeps_remainders(option: str) -> bool:
    """Whether the option keeps the masters as bf16 weights plus remainders (`_rem`)."""
    return option.endswith("_rem")


def to_bf16(master: torch.Tensor, remainders: bool) -> torch.Tensor:
    """The bf16 weights of fp32 masters: torch's cast (ties to even), or the remainder split's (ties away)."""
    if not remainders:
        return master.to(torch.bfloat16)
    from hfsdp.core.buffers.param_remainders import split_master

    return split_master(master.float())[0]


@dataclass(frozen=True)
class Shape:
    """The model and run of the issue that found the compile defect: a Llama of 8 layers, hidden 2048."""

    layers: int = 8
    hidden: int = 2048
    heads: int = 16
    kv_heads: int = 16
    ffn: int = 5632
    vocab: int = 32000
    seq: int = 1024
    micro_batch: int = 4
    microbatches: int = 2
    steps: int = 6
    lr: float = 1e-3
    clip: float = 1.0


@dataclass(frozen=True)
class Case:
    engine: str  # "reference" | "fsdp2" | "hfsdp"
    style: str = "eager"
    option: str = ""
    repeat: int = 0  # the how-many-th run of the same case in this process
    layout: str = ""  # "" ZeRO-3 over every rank; "hsdp" / "hfsdp": 2 instances (FSDP2: HSDP on the same mesh)

    @property
    def name(self) -> str:
        return "/".join(x for x in (self.engine, self.style, self.option) if x) + (
            f"@{self.layout}" if self.layout else ""
        )

    @property
    def kernels(self) -> str:
        """Which compiled kernels this case runs: none ("eager"), the layers' ("module": every way of compiling
        them traces the same graph), or the whole model's ("model")."""
        return self.style if self.style in ("eager", "model") else "module"

    @property
    def exact(self) -> bool:
        """Whether the case runs its witness's arithmetic op for op (it may differ only in the order of a few
        sums), or rounds otherwise by design: offload steps AdamW on the CPU, FusedAdamW is its own kernel, and a
        hybrid layout sums the gradients over two axes, in another order than FSDP2's HSDP."""
        return self.option != "offload" and not optimizer_of(self.option).startswith("fused") and not self.layout

    @property
    def witnesses(self) -> list[str]:
        """The cases this one is checked against: the reference of the same kernels and FSDP2's where FSDP2 runs
        them. A compiled whole model has FSDP2 alone: the plain model compiles its root (embedding, norm, head)
        into one graph, which hfsdp's and FSDP2's root hooks break into several, fused otherwise."""
        hybrid = "hsdp" if self.layout else ""
        fsdp2 = [] if self.option else [Case("fsdp2", self.kernels, layout=hybrid).name]
        return fsdp2 if self.style == "model" or self.layout else [self.reference_name, *fsdp2]

    @property
    def reference_name(self) -> str:
        """The reference case this one must agree with: the same kernels (compiled ones round otherwise than eager
        ones) and the same optimizer kernel; offload and recompute change neither."""
        optimizer = optimizer_of(self.option)
        fused = "fused" + precision_of(optimizer) if optimizer.startswith("fused") else ""
        fused += "_rem" if keeps_remainders(optimizer) else ""
        return Case("reference", self.kernels, "_".join(x for x in (fp8_of(self.option), fused) if x)).name


def build_llama(shape: Shape, device: torch.device):
    from transformers import LlamaConfig

    from hfsdp.models import hf

    config = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.seq,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return hf.build_causal_lm(config, seed=SEED, device=device)  # on the device: the same weights in every process


def batches(shape: Shape, world: int, rank: int, device: torch.device) -> list[list[tuple]]:
    """Every step's microbatches for `rank` (chunk m * world + rank of the global batch, as hfsdp splits it)."""
    from hfsdp.recipes.data import SyntheticTokens, microbatch

    data = SyntheticTokens(shape.vocab, shape.seq, seed=SEED)
    size = shape.micro_batch * shape.microbatches * world
    out = []
    for step in range(shape.steps):
        batch = data.global_batch(step, size)
        count = shape.microbatches
        out.append([tuple(t.to(device) for t in microbatch(batch, i, count, rank, world)) for i in range(count)])
    return out


def unit_forward():
    """hfsdp's unit_forward module where this checkout has it, or where an earlier engine (`--baseline`, before the
    core was grouped into subpackages) kept it."""
    try:
        from hfsdp.core.engine import unit_forward
    except ModuleNotFoundError:
        from hfsdp.core import unit_forward
    return unit_forward


def compile_units(model, style: str) -> None:
    """Compile the decoder layers the way `style` names (before sharding; "model" compiles after it)."""
    cli_compile = unit_forward().compile_units
    layers = model.model.layers
    if style == "module":
        for layer in layers:
            layer.compile()
    elif style == "fullgraph":
        for layer in layers:
            layer.compile(fullgraph=True)
    elif style == "wrapper":
        for i in range(len(layers)):
            layers[i] = torch.compile(layers[i])
    elif style == "forward":
        for layer in layers:
            layer.forward = torch.compile(layer.forward)
    elif style == "cli":
        cli_compile(layers)  # what `hfsdp train --compile` does


def _loss(model, tokens, labels):
    from hfsdp.models.hf import causal_lm_loss

    return causal_lm_loss(model, tokens, labels)


def _weights_digest(weights: dict[str, torch.Tensor]) -> str:
    """A checksum of every bit of `weights`, computed where they are: each fp32 weight's bits as an integer, summed
    with a position-dependent odd multiplier (any change of one element changes it), then the names and sums
    hashed. Not a cryptographic hash; a bit-identity test between runs."""
    h = hashlib.sha256()
    for name in sorted(weights):
        bits = weights[name].detach().contiguous().view(-1).view(torch.int32).to(torch.int64)
        position = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64)
        mixed = bits * (position * 2654435761 % 4294967291 * 2 + 1)
        h.update(f"{name}:{int(mixed.sum())}:{int(bits.sum())};".encode())
    return h.hexdigest()


def _adamw(params, shape: Shape, option: str, sanitizer: bool, engine: bool = False):
    """The case's optimizer (`engine`: over hfsdp's parameters, where remainders are kept if the option says)."""
    option = optimizer_of(option)
    if option.startswith("fused"):
        from hfsdp.core import FusedAdamW

        prestage = option.startswith("fused_clip_prestage")
        clip = shape.clip if prestage else None
        # Under the sanitizer the torch path: a Triton kernel is invisible to it (the same ordering, seen op by op).
        backend = "torch" if sanitizer else "auto"
        moments = "fp8" if "_fp8m" in option else "bf16" if "_bf16m" in option else "fp32"
        return FusedAdamW(params, lr=shape.lr, weight_decay=0.1, max_grad_norm=clip, prestage_gathers=prestage,
                          overlap_next_forward=option.endswith("_overlap"), backend=backend,
                          exp_avg_dtype=moments, exp_avg_sq_dtype=moments,
                          store_param_remainders=engine and keeps_remainders(option))  # fmt: skip
    return torch.optim.AdamW(params, lr=shape.lr, weight_decay=0.1, fused=True)


class Reference:
    """The recipe in plain PyTorch on one process: a bf16 model computes, fp32 masters are stepped."""

    def __init__(self, case: Case, shape: Shape, device, sanitizer: bool):
        self.shape, self.bf16_grads = shape, case.option.endswith("_bf16g")
        self.remainders = keeps_remainders(case.option)
        fp32 = build_llama(shape, device)
        self.masters = {n: p.detach().clone() for n, p in fp32.named_parameters()}
        self.model = copy.deepcopy(fp32)
        del fp32
        for p in self.model.parameters():  # the parameters only: buffers (RoPE's inv_freq) stay fp32, as in hfsdp
            p.data = to_bf16(p.data, self.remainders)
        convert_fp8(self.model, case.option)
        compile_units(self.model, case.style)
        if case.style == "model":
            self.model.compile()
        self.params = dict(self.model.named_parameters())
        self.opt = _adamw(list(self.masters.values()), shape, case.option, sanitizer)

    def step(self, microbatches) -> torch.Tensor:
        grads = {n: torch.zeros_like(m) for n, m in self.masters.items()}
        total = torch.zeros((), device=next(iter(grads.values())).device)
        for tokens, labels in microbatches:
            loss = _loss(self.model, tokens, labels)
            loss.backward()
            for n, p in self.params.items():
                grads[n].add_(p.grad.float())  # fp32 accumulation, as hfsdp's gradient buffer
                p.grad = None
            total += loss.detach()
        for n, m in self.masters.items():
            m.grad = grads[n].mul_(1.0 / len(microbatches))
            if self.bf16_grads:  # hfsdp reduces in bf16 and steps from it
                m.grad = m.grad.bfloat16().float()
        if self.shape.clip:
            torch.nn.utils.clip_grad_norm_(list(self.masters.values()), self.shape.clip, foreach=True)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(to_bf16(self.masters[n], self.remainders))
        return total / len(microbatches)

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: m.detach() for n, m in self.masters.items()}


class Fsdp2:
    """FSDP2 on the same mesh shape: every decoder layer and the root, bf16 compute, fp32 reductions."""

    def __init__(self, case: Case, shape: Shape, device, sanitizer: bool):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self.shape = shape
        model = build_llama(shape, device)
        compile_units(model, case.style)
        world = dist.get_world_size()
        if case.layout:  # HSDP: replicate over 2 instances, shard inside each
            mesh = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("dp_outer", "dp_shard"))
        else:
            mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp_shard",))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        if case.style == "model":
            model.compile()
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=shape.lr, weight_decay=0.1, fused=True)

    def step(self, microbatches) -> torch.Tensor:
        total = None
        for tokens, labels in microbatches:
            loss = _loss(self.model, tokens, labels)
            (loss / len(microbatches)).backward()
            total = loss.detach() if total is None else total + loss.detach()
        if self.shape.clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.shape.clip, foreach=True)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return total / len(microbatches)

    def weights(self) -> dict[str, torch.Tensor] | None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if dist.get_world_size() == 1:  # one rank: the local shards are whole, and stay on the device
            return {n: p.to_local().detach() for n, p in self.model.named_parameters()}
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = get_model_state_dict(self.model, options=options)
        return {n.replace("._orig_mod", ""): t.float() for n, t in full.items()} if dist.get_rank() == 0 else None


class Hfsdp:
    """hfsdp's `fully_shard` with the case's option, its decoder layers the units."""

    def __init__(self, case: Case, shape: Shape, device, sanitizer: bool):
        from hfsdp.core import LayoutConfig, MixedPrecision, build_meshes, fully_shard

        recompute = unit_forward().recompute

        self.shape, self.option = shape, case.option
        model = build_llama(shape, device)
        fp8_gather = convert_fp8(model, case.option)
        compile_units(model, case.style)
        if case.option == "recompute":
            recompute(model.model.layers)
        hybrid = {"hsdp": {"instances": 2}, "hfsdp": {"instances": 2, "outer": "optim"}}.get(case.layout, {})
        cfg = LayoutConfig(world_size=dist.get_world_size(), **hybrid)
        planned = contextlib.nullcontext()
        if plans_single_rank_collectives(case.option):  # imported here: a `--baseline` engine may predate it
            from hfsdp.core.rules.comm_plan import single_rank_collectives

            planned = single_rank_collectives()
        with planned:
            self.model = fully_shard(
                model,
                cfg,
                build_meshes(cfg, device.type),
                units=model.model.layers,
                mp=MixedPrecision(
                    param_dtype=torch.bfloat16,
                    reduce_dtype=torch.bfloat16 if case.option.endswith("_bf16g") else torch.float32,
                ),
                offload=case.option == "offload",
                fp8_param_gather=fp8_gather,
            )
        if case.style == "model":
            self.model.compile()
        self.opt = _adamw(self.model.parameters(), shape, case.option, sanitizer, engine=True)

    def step(self, microbatches) -> torch.Tensor:
        total = None
        for index, (tokens, labels) in enumerate(microbatches):
            self.model.set_microbatch(index, len(microbatches))
            loss = _loss(self.model, tokens, labels)
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        if self.shape.clip and not optimizer_of(self.option).startswith("fused_clip_prestage"):
            self.model.clip_grad_norm_(self.shape.clip)
        self.opt.step()
        self.opt.zero_grad()
        return total / len(microbatches)

    def weights(self) -> dict[str, torch.Tensor] | None:
        self.model.wait_for_weights()  # read outside forward right after a step (an overlapped one may be running)
        if dist.get_world_size() == 1:  # one rank: the main params are whole (on the host with offload)
            from hfsdp.core.buffers.main_params import piece_of

            return {n: piece_of(p).master() for n, p in self.model.named_parameters()}  # fp32 (joined: remainders)
        full = self.model.state_dict()  # collective; whole on rank 0, on the CPU
        return {n: t.float() for n, t in full.items()} if dist.get_rank() == 0 else None


ENGINES = {"reference": Reference, "fsdp2": Fsdp2, "hfsdp": Hfsdp}


def run_case(case: Case, shape: Shape, device, sanitizer: bool = False) -> dict:
    """Train `case` for `shape.steps` steps: losses, wall time, final weights (rank 0) and their digest."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if case.engine == "reference" and world > 1:
        raise ValueError("the reference runs on one process: pass it only with --nproc 1 (rank 0 alone)")
    torch._dynamo.reset()
    began = time.perf_counter()
    engine = ENGINES[case.engine](case, shape, device, sanitizer)
    losses = []
    with _comm_log(case) as log:
        for microbatches in batches(shape, world, rank, device):
            loss = engine.step(microbatches)
            if world > 1:
                dist.all_reduce(loss)
                loss /= world
            losses.append(loss.item())
    weights = engine.weights()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - began
    del engine
    return {
        "case": case.name,
        "repeat": case.repeat,
        "losses": losses,
        "digest": _weights_digest(weights) if weights is not None else None,
        "weights": weights,
        "seconds": seconds,
        # which collectives hfsdp issued, with their element sizes (an fp8 gather moves 1 byte per element)
        "collectives": sorted({f"{r.op}:{r.element_size}" for r in log.records}) if log is not None else None,
    }


@contextlib.contextmanager
def _comm_log(case: Case):
    """hfsdp's communication log around a case's steps (None for other engines, or an engine without one)."""
    try:
        from hfsdp.core.buffers.collectives import record_comms
    except ImportError:
        record_comms = None
    if case.engine != "hfsdp" or record_comms is None:
        yield None
        return
    with record_comms() as log:
        yield log
