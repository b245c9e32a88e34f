"""Everything a training run can be told, in one table: flag, config-file key, default, help, rule.

`hfsdp train` generates its options from `SETTINGS` (each a `Setting`, `setting.py`), the config-file reader finds keys
through it, and `train_config.resolve` checks every value with the rules written here
(and those between settings, in `rules.py`), for `hfsdp train` and `hfsdp validate-config`
alike: one set of rules, so a file one accepts the other accepts. Adding a setting is one
`Setting(...)` entry (and, when it relates to others, one `Rule` in `rules.py`).

Layout settings (`layout=True`) are checked by core's `LayoutConfig`, the one home of
the layout rules; their file keys are core's `MEGATRON_NAMES`. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import MISSING, fields
from typing import Any

from hfsdp.cli.settings.resilience_settings import RESILIENCE_SETTINGS
from hfsdp.cli.settings.setting import (
    Check,
    Setting,
    boolean,
    fraction_or_auto,
    non_negative_int,
    non_negative_number,
    one_of,
    path,
    positive_int,
    positive_number,
    seed,
    step_range,
    unit_interval,
)
from hfsdp.core.outer.outer_config import COMM_DTYPES, CONFIG_KEYS, DiLoCoConfig
from hfsdp.core.rules.config import MEGATRON_NAMES
from hfsdp.core.rules.strategy import Strategy

STRATEGIES = ", ".join(Strategy.names()) + " (or ddp, zero1, zero2, zero3)"
INNER_STRATEGIES = ", ".join(s.value for s in Strategy.sharding()) + " (or ddp, zero1, zero2, zero3)"
DTYPES = ("fp32", "bf16")  # what the trainer runs; fp16 would need loss scaling, which it does not do
DEVICES = ("auto", "cpu", "cuda")
NORMS = ("LayerNorm", "RMSNorm")
DECAY_STYLES = ("constant", "linear", "cosine")
OFFLOADS = ("none", "optim")
ADAM_KERNELS = ("auto", "fused", "torch")  # hfsdp's FusedAdamW, or torch's fused AdamW
OPTIMIZERS = ("adam", "sgd")  # Megatron's --optimizer: adam is AdamW (decoupled weight decay), as in Megatron
#: Megatron's precision-aware optimizer (`--use-precision-aware-optimizer`): the dtypes each of its settings may take,
#: by Megatron's names. The moments' are core's `optimizer_dtypes.STATE_DTYPE_NAMES` (fp8: e4m3 for exp_avg, e5m2 for
#: exp_avg_sq, a scale per 128-element block); kept here as text so that nothing here imports torch.
MAIN_GRADS_DTYPES = ("fp32", "bf16")
MAIN_PARAMS_DTYPES = ("fp32", "fp16")
MOMENT_DTYPES = ("fp32", "fp16", "bf16", "fp8")
#: The precision settings, each fp32 by default and non-fp32 only with use_precision_aware_optimizer (Megatron's rule).
PRECISION_DTYPES = ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
#: FP8 training (Megatron's `--fp8-format`, `--fp8-recipe`): core's `fp8.config.FORMATS` and `RECIPES`, kept here as
#: text so that nothing here imports core's fp8 package (hybrid: e4m3 forward, e5m2 gradients).
FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("tensorwise", "rowwise")
#: `--fp8-min-size`'s default: core's `fp8.convert.DEFAULT_MIN_SIZE` (a Linear layer is converted only when
#: in*out/(in+out) reaches it; measured on an H200, smaller layers are slower in fp8 than in bf16), kept here as a
#: number so that nothing here imports core's fp8 package (which imports torch).
FP8_MIN_SIZE = 2048
#: DiLoCo's settings (`--outer diloco`), by TrainConfig name (the flag's) -> DiLoCoConfig field.
DILOCO_SETTINGS = {flag[2:].replace("-", "_"): field for field, (_, flag) in CONFIG_KEYS.items()}
#: The settings that shape the megatron-core GPT; a Hugging Face config (--model-config) replaces them all.
GPT_SETTINGS = ("layers", "hidden", "heads", "vocab", "normalization", "swiglu", "num_query_groups", "num_moe_experts")


def _fp8_choice(choices: tuple[str, ...], means: str) -> Check:
    """`one_of(choices)` whose refusal also says what the choices mean (Megatron has recipes hfsdp has not), unless
    it guesses a typo."""
    choose = one_of(*choices)

    def check(value: object) -> str | None:
        wrong = choose(value)
        return wrong if wrong is None or "did you mean" in wrong else f"{wrong} ({means})"

    return check


def _fp8_min_size(value: object) -> str | None:
    """A number >= 0 (0: every Linear layer whose dims fit), saying what it measures."""
    if non_negative_number(value) is None:
        return None
    return (
        f"must be a number >= 0 such as 0 or {FP8_MIN_SIZE}: a Linear layer multiplies in fp8 only when its "
        "in*out/(in+out) is at least this (0: every layer whose dims are multiples of 16)"
    )


def _layout(name: str, flag: str | None, default: Any, type_: type, help_text: str, **kw) -> Setting:
    """A LayoutConfig field: its file key is core's MEGATRON_NAMES entry, its rules are LayoutConfig's."""
    return Setting(name, flag, default, type_, help_text, key=MEGATRON_NAMES[name], layout=True, panel="Layout", **kw)


def _model(name: str, flag: str, default: int, key: str, help_text: str, arch: bool = True) -> Setting:
    """A size of the model: a positive whole number under `model.` in a config file."""
    return Setting(name, flag, default, int, help_text, positive_int, key=f"model.{key}", arch=arch, panel="Model")


def _output(name: str, flag: str, default: Any, type_: type, help_text: str, check: Check, shown: str) -> Setting:
    """A flag-only setting about where results go (--metrics, checkpoints): shown default in words."""
    panel = "Checkpoints" if name.startswith(("save", "load")) else "Output"
    return Setting(name, flag, default, type_, help_text, check, panel=panel, default_text=shown)


def _diloco_settings() -> tuple[Setting, ...]:
    """DiLoCo's settings: flags, `diloco.*` keys and defaults are core's `DiLoCoConfig`'s (H has none: set it)."""
    defaults = {f.name: None if f.default is MISSING else f.default for f in fields(DiLoCoConfig)}
    about = {
        "sync_every": (int, "optimizer steps between two outer steps of a fragment (H); required.", positive_int),
        "lr": (float, "learning rate of the outer SGD.", positive_number),
        "momentum": (float, "momentum of the outer SGD (0: none).", unit_interval),
        "nesterov": (bool, "Nesterov momentum in the outer SGD.", boolean),
        "comm_dtype": (str, f"what the exchange sends: {', '.join(COMM_DTYPES)}.", one_of(*COMM_DTYPES)),
        "fragments": (int, "units cut into F groups synced at staggered steps (Streaming DiLoCo).", positive_int),
    }
    out = []
    for name, field in DILOCO_SETTINGS.items():
        type_, text, check = about[field]
        key, flag = CONFIG_KEYS[field]
        shown = "none (set it)" if defaults[field] is None else None
        out.append(Setting(name, flag, defaults[field], type_, f"DiLoCo: {text}", check, key=key, panel="DiLoCo",
                           default_text=shown))  # fmt: skip
    return tuple(out)


SETTINGS: tuple[Setting, ...] = (
    # The layout. world_size comes from --nproc, the file or torchrun (train_config._world), never a flag of its own.
    _layout("world_size", None, None, int, "Ranks in the whole job.", default_text="--nproc"),
    _layout("tp", None, 1, int, "Tensor-parallel size (1: not supported yet)."),
    _layout("pp", None, 1, int, "Pipeline-parallel size (1: not supported yet)."),
    _layout("cp", None, 1, int, "Context-parallel size (1: not supported yet)."),
    _layout(
        "inner",
        "--inner",
        "optim_grads_params",
        str,
        f"Sharding inside an instance (data_parallel_sharding_strategy): {INNER_STRATEGIES}.",
    ),
    _layout(
        "outer",
        "--outer",
        "no_shard",
        str,
        f"Across instances (outer_dp_sharding_strategy): {STRATEGIES}; diloco: apart, met every --sync-every steps.",
    ),
    _layout("instances", "--instances", 1, int, "Number of instances (num_distributed_optimizer_instances)."),
    _layout("ep", "--ep", 1, int, "Expert-parallel size."),
    _layout(
        "expert_strategy", "--expert-strategy", None, str, f"Sharding of experts: {STRATEGIES}.", default_text="--inner"
    ),
    _layout("expert_instances", "--expert-instances", 1, int, "Opt-in outer axis for experts: its size."),
    _layout(
        "expert_outer", "--expert-outer", "no_shard", str, f"Opt-in outer axis for experts: its sharding, {STRATEGIES}."
    ),
    _layout("num_moe_experts", "--moe-experts", None, int, "MoE experts; 0: a dense model.", default_text="0"),
    _layout(
        "global_batch_size",
        "--global-batch-size",
        None,
        int,
        "Sequences per optimizer step (gradient accumulation follows).",
        default_text="2 microbatches: 2 x micro-batch-size x ranks",
    ),
    _layout("micro_batch_size", "--micro-batch-size", 2, int, "Sequences per rank per microbatch."),
    Setting(
        "nproc",
        "--nproc",
        4,
        int,
        "Processes on this node (ignored under an external torchrun, whose WORLD_SIZE counts).",
        default_text="the config file's world size, else 4",
        panel="Layout",
    ),
    # The model.
    _model("layers", "--layers", 2, "num_layers", "Transformer layers."),
    _model("hidden", "--hidden", 64, "hidden_size", "Hidden size."),
    _model("heads", "--heads", 4, "num_attention_heads", "Attention heads."),
    _model("vocab", "--vocab", 128, "vocab_size", "Vocabulary size."),
    _model("seq_len", "--seq-len", 32, "seq_length", "Sequence length.", arch=False),
    _model("moe_topk", "--moe-topk", 2, "moe_router_topk", "Experts per token (MoE).", arch=False),
    Setting(
        "normalization",
        "--normalization",
        "LayerNorm",
        str,
        f"Norm of the GPT's layers: {', '.join(NORMS)} (RMSNorm + --swiglu, no biases: a Llama).",
        one_of(*NORMS),
        key="model.normalization",
        arch=True,
        panel="Model",
    ),
    Setting(
        "swiglu",
        "--swiglu",
        False,
        bool,
        "Gated SiLU MLP (SwiGLU) in the GPT's layers, as Llama has.",
        boolean,
        key="model.swiglu",
        arch=True,
        panel="Model",
    ),
    Setting(
        "num_query_groups",
        "--num-query-groups",
        None,
        int,
        "Grouped-query attention: key/value heads of the GPT.",
        positive_int,
        key="model.num_query_groups",
        arch=True,
        panel="Model",
        default_text="--heads",
    ),
    Setting(
        "model_config",
        "--model-config",
        None,
        str,
        "A Hugging Face causal LM's config.json (Llama, Qwen2, Mistral, ...) to train instead of the GPT.",
        path,
        key="model.hf_config",
        panel="Model",
        default_text="a megatron-core GPT",
    ),
    Setting(
        "recompute",
        "--recompute",
        False,
        bool,
        "Recompute every unit's activations in backward (activation checkpointing) to save memory.",
        boolean,
        key="train.recompute",
        panel="Model",
    ),
    Setting(
        "offload",
        "--offload",
        "none",
        str,
        f"What lives in host memory: {', '.join(OFFLOADS)} (optim: the fp32 main weights and AdamW state; the "
        "optimizer steps on the CPU).",
        one_of(*OFFLOADS),
        key="train.offload",
        panel="Model",
    ),
    Setting(
        "offload_fraction",
        "--offload-fraction",
        "1",
        str,
        "With --offload optim: the share of the optimizer state in host memory (0 to 1, last layers first), or "
        "auto: what the GPU cannot hold.",
        fraction_or_auto,
        key="train.offload_fraction",
        panel="Model",
    ),
    Setting(
        "compile",
        "--compile",
        False,
        bool,
        "torch.compile every unit's forward.",
        boolean,
        key="train.compile",
        panel="Model",
    ),
    # The loop.
    Setting(
        "steps",
        "--steps",
        20,
        int,
        "Total optimizer steps of the run, counted from step 0: a resume continues up to this count.",
        positive_int,
        key="train.train_iters",
    ),
    Setting(
        "optimizer",
        "--optimizer",
        "adam",
        str,
        f"The (inner) optimizer, Megatron's choice: {', '.join(OPTIMIZERS)} (adam: AdamW, fused).",
        one_of(*OPTIMIZERS),
        key="train.optimizer",
    ),
    Setting(
        "adam_kernel",
        "--adam-kernel",
        "auto",
        str,
        f"AdamW of --optimizer adam: {', '.join(ADAM_KERNELS)} (fused: hfsdp's FusedAdamW, clip and bf16 cast in "
        "its step; auto: fused on a GPU without offload or DiLoCo).",
        one_of(*ADAM_KERNELS),
        key="train.adam_kernel",
    ),
    Setting(
        "use_precision_aware_optimizer",
        "--use-precision-aware-optimizer",
        False,
        bool,
        "Megatron's: FusedAdamW keeps gradients and moments in the dtypes below (all fp32 without it).",
        boolean,
        key="train.use_precision_aware_optimizer",
        panel="Optimizer precision",
    ),
    Setting(
        "main_grads_dtype",
        "--main-grads-dtype",
        "fp32",
        str,
        f"Gradients reduced and kept in: {', '.join(MAIN_GRADS_DTYPES)} (bf16: MixedPrecision reduce_dtype).",
        one_of(*MAIN_GRADS_DTYPES),
        key="train.main_grads_dtype",
        panel="Optimizer precision",
    ),
    Setting(
        "main_params_dtype",
        "--main-params-dtype",
        "fp32",
        str,
        f"Main weights: {', '.join(MAIN_PARAMS_DTYPES)} (fp16: not implemented, fp32 masters are kept).",
        one_of(*MAIN_PARAMS_DTYPES),
        key="train.main_params_dtype",
        panel="Optimizer precision",
    ),
    Setting(
        "exp_avg_dtype",
        "--exp-avg-dtype",
        "fp32",
        str,
        f"AdamW's first moment: {', '.join(MOMENT_DTYPES)} (fp8: e4m3, a scale per 128 elements).",
        one_of(*MOMENT_DTYPES),
        key="train.exp_avg_dtype",
        panel="Optimizer precision",
    ),
    Setting(
        "exp_avg_sq_dtype",
        "--exp-avg-sq-dtype",
        "fp32",
        str,
        f"AdamW's second moment: {', '.join(MOMENT_DTYPES)} (fp8: e5m2, a scale per 128 elements).",
        one_of(*MOMENT_DTYPES),
        key="train.exp_avg_sq_dtype",
        panel="Optimizer precision",
    ),
    Setting(
        "store_param_remainders",
        "--store-param-remainders",
        None,
        bool,
        "Megatron's: exact fp32 masters as the bf16 weights plus 16-bit remainders (docs/cli.md).",
        boolean,
        key="train.store_param_remainders",
        panel="Optimizer precision",
        default_text="on with --use-precision-aware-optimizer where it applies",
    ),
    Setting(
        "fp8",
        "--fp8-format",
        None,
        str,
        f"FP8 matmuls in the Linear layers of the transformer layers (a Hugging Face model, --dtype bf16): "
        f"{', '.join(FP8_FORMATS)} (hybrid: e4m3 forward, e5m2 gradients).",
        _fp8_choice(FP8_FORMATS, "e4m3 for every tensor, or hybrid: e4m3 forward, e5m2 gradients; unset: no fp8"),
        key="model.fp8",
        panel="FP8",
        default_text="off",
    ),
    Setting(
        "fp8_recipe",
        "--fp8-recipe",
        "tensorwise",
        str,
        f"How fp8 scales are taken: {', '.join(FP8_RECIPES)} (one scale per tensor, or per row).",
        _fp8_choice(FP8_RECIPES, "one scale per tensor, or one per row; hfsdp has no delayed, blockwise or mxfp8"),
        key="model.fp8_recipe",
        panel="FP8",
    ),
    Setting(
        "fp8_min_size",
        "--fp8-min-size",
        FP8_MIN_SIZE,
        float,
        "Convert only Linear layers with in*out/(in+out) at least this (smaller: slower in fp8); 0: all.",
        _fp8_min_size,
        key="model.fp8_min_size",
        panel="FP8",
        default_text=str(FP8_MIN_SIZE),
    ),
    Setting(
        "fp8_param_gather",
        "--fp8-param-gather",
        False,
        bool,
        "Gather the converted weights in fp8 (half bf16's bytes), quantized on their shards; tensorwise only.",
        boolean,
        key="ddp.fp8_param_gather",
        panel="FP8",
    ),
    Setting(
        "overlap_step",
        "--overlap-step",
        False,
        bool,
        "On a GPU, bf16, with FusedAdamW (--adam-kernel fused or auto): each layer's optimizer step on a side "
        "stream, overlapping the next forward; the same weights, bit for bit.",
        boolean,
        key="train.overlap_step",
    ),
    Setting(
        "sgd_momentum",
        "--sgd-momentum",
        0.9,
        float,
        "Momentum of --optimizer sgd (0: plain SGD).",
        unit_interval,
        key="train.sgd_momentum",
    ),
    Setting(
        "lr",
        "--lr",
        3e-3,
        float,
        "Learning rate of the (inner) optimizer; when set, wins over a resumed checkpoint's.",
        positive_number,
        key="train.lr",
    ),
    Setting(
        "lr_warmup_iters",
        "--lr-warmup-iters",
        0,
        int,
        "Steps of linear warmup from 0 to --lr.",
        non_negative_int,
        key="train.lr_warmup_iters",
    ),
    Setting(
        "lr_decay_style",
        "--lr-decay-style",
        "constant",
        str,
        f"Learning-rate decay after warmup: {', '.join(DECAY_STYLES)} (to --min-lr at --lr-decay-iters).",
        one_of(*DECAY_STYLES),
        key="train.lr_decay_style",
    ),
    Setting(
        "lr_decay_iters",
        "--lr-decay-iters",
        None,
        int,
        "Step at which the decay reaches --min-lr (held there after).",
        positive_int,
        key="train.lr_decay_iters",
        default_text="--steps",
    ),
    Setting(
        "min_lr",
        "--min-lr",
        0.0,
        float,
        "Learning rate at the end of the decay.",
        non_negative_number,
        key="train.min_lr",
    ),
    Setting(
        "weight_decay",
        "--weight-decay",
        0.01,
        float,
        "Weight decay of the (inner) optimizer; when set, wins over a resumed checkpoint's.",
        non_negative_number,
        key="train.weight_decay",
    ),
    Setting(
        "clip_grad",
        "--clip-grad",
        1.0,
        float,
        "Clip gradients to this global norm (0: off).",
        non_negative_number,
        key="train.clip_grad",
    ),
    Setting("seed", "--seed", 0, int, "Seed of the model's initialisation.", seed, key="train.seed"),
    *_diloco_settings(),  # --outer diloco: the outer step every --sync-every steps
    Setting(
        "dtype",
        "--dtype",
        "fp32",
        str,
        "Compute dtype: fp32 or bf16 (main weights and Adam state stay fp32).",
        one_of(*DTYPES),
        key="train.dtype",
    ),
    Setting("device", "--device", "auto", str, f"Where to train: {', '.join(DEVICES)}.", one_of(*DEVICES)),
    Setting(
        "data_path",
        "--data-path",
        None,
        str,
        "Prefix of a Megatron indexed dataset (PREFIX.bin, PREFIX.idx; hfsdp data prepare makes one).",
        path,
        default_text="a learnable synthetic stream",
    ),
    Setting(
        "eval_interval",
        "--eval-interval",
        None,
        int,
        "Every K steps, report the loss on held-out data (and at the end).",
        positive_int,
        key="train.eval_interval",
        panel="Output",
        default_text="no evaluation",
    ),
    Setting(
        "eval_iters",
        "--eval-iters",
        2,
        int,
        "Global batches of held-out data per evaluation.",
        positive_int,
        key="train.eval_iters",
        panel="Output",
    ),
    # Output and checkpoints.
    _output("metrics", "--metrics", None, str, "Write one JSON object per step to this file.", path, "none"),
    _output(
        "tensorboard_dir",
        "--tensorboard-dir",
        None,
        str,
        "Write TensorBoard curves to this directory: loss, eval loss, learning rate, grad norm, tokens/s and memory "
        "per step (needs the tensorboard package).",
        path,
        "none",
    ),
    _output(
        "profile_dir",
        "--profile-dir",
        None,
        str,
        "Record the steps of --profile-steps with torch.profiler into this directory: a Chrome/Perfetto trace per "
        "rank and rank 0's table of the costliest operators.",
        path,
        "none",
    ),
    Setting(
        "profile_steps",
        "--profile-steps",
        "3-4",
        str,
        "Steps --profile-dir records, FIRST-LAST counted from 1 as the progress line counts them (one step: K).",
        step_range,
        panel="Output",
    ),
    Setting(
        "log_every",
        "--log-every",
        10,
        int,
        "When stdout is not a terminal, print a progress line every K steps.",
        positive_int,
        key="train.log_interval",
        panel="Output",
    ),
    _output("save", "--save", None, str, "Checkpoint root to save into (DIR/step-K, DIR/latest).", path, "none"),
    _output("save_every", "--save-every", None, int, "Save every K steps, and at the end.", positive_int, "at the end"),
    _output(
        "save_keep",
        "--save-keep",
        None,
        int,
        "Keep the newest N step directories; older ones are deleted after each new save (never the latest).",
        positive_int,
        "all",
    ),
    _output(
        "load",
        "--load",
        None,
        str,
        "Checkpoint (a root with 'latest', or a step directory) to resume from.",
        path,
        "none",
    ),
    *RESILIENCE_SETTINGS,
)

BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}
#: Config-file key -> setting name.
KEYS: dict[str, str] = {s.key: s.name for s in SETTINGS if s.key}
