"""hfsdp.recipes: what a training run needs besides the model and the engine.

- `data`: token streams defined by global batch (a learnable synthetic one, Megatron indexed datasets);
- `lr_schedule`: Megatron's warmup and decay as a `torch.optim.lr_scheduler.LambdaLR`.
"""
