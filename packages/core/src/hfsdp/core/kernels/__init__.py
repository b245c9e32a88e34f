"""Fused optimizer kernels: one pass of AdamW over a contiguous run (`adamw_kernel`: Triton, and a plain-torch
twin with the same bits) and `FusedAdamW`, the opt-in `torch.optim.AdamW` that steps with it.

May import `buffers` and `engine`.
"""
