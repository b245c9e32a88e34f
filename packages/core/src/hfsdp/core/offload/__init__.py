"""Optimizer state in host memory: which units offload (`offload_plan`: all, none, a share, or "auto") and the
exact-size page-locked buffers they live in (`host_memory`).

May import `rules`.
"""
