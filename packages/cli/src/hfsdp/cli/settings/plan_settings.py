"""`hfsdp plan`'s rows: the train settings a plan depends on, and the cluster's flags.

Read by the command (its options, `commands/plan.py`) and by the validation of its inputs
(`commands/plan_setup.py`); here, below both, so neither imports the other for them.
"""

from __future__ import annotations

#: The train settings a plan depends on; the rest take train's defaults.
PLAN_SETTINGS = (
    "model_config",
    "layers",
    "hidden",
    "heads",
    "vocab",
    "normalization",
    "swiglu",
    "num_query_groups",
    "num_moe_experts",
    "moe_topk",
    "ep",
    "expert_strategy",
    "seq_len",
    "micro_batch_size",
    "global_batch_size",
    "dtype",
    "recompute",
    "offload",
    "use_precision_aware_optimizer",
    "main_grads_dtype",
    "main_params_dtype",
    "exp_avg_dtype",
    "exp_avg_sq_dtype",
    "store_param_remainders",
    "fp8",
    "fp8_recipe",
    "fp8_min_size",
    "fp8_param_gather",
    "inner",
    "outer",
    "instances",
)
#: The cluster: flag, attribute of `Cluster`, default, help.
CLUSTER_FLAGS = (
    ("--nodes", "nodes", 1, int, "Nodes in the cluster."),
    ("--gpus-per-node", "gpus_per_node", 8, int, "GPUs per node; ranks are numbered node by node."),
    ("--gpu-memory", "gpu_memory_gib", 141e9 / 2**30, float, "Memory per GPU in GiB (H200: 141 GB = 131.3 GiB)."),
    (
        "--intra-node-bandwidth",
        "intra_gbps",
        450.0,
        float,
        "GB/s each GPU sends inside a node, each way (NVLink 4: 900 GB/s both ways together).",
    ),
    ("--inter-node-bandwidth", "inter_gbits", 400.0, float, "Gb/s each GPU sends between nodes (its NIC)."),
    (
        "--peak-tflops",
        "peak_tflops",
        None,
        float,
        "Dense peak TFLOP/s of one GPU in the compute dtype (default: H200's 989 for bf16, 67 for fp32).",
    ),
    (
        "--mfu",
        "mfu",
        None,
        float,
        "Fraction of the peak a forward and backward reaches (default: measured on one H200, docs/planning.md: "
        "0.27 for the megatron GPT, 0.40 for Hugging Face models).",
    ),
)
