"""hfsdp.models: the models hfsdp trains out of the box, beside the engine and built on it.

- `hf`: causal language models built by transformers from a `config.json` (needs the `hf` extra);
- `megatron`: the megatron-core GPT, its process groups, the CPU shim, and the mapping of a
  Llama-shaped GPT to transformers' names (needs the `megatron` extra).

Nothing in `hfsdp.core` imports this package: the engine shards any `nn.Module`.
"""
