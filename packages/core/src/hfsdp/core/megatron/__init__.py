"""The megatron-core adapter: process groups, the GPT model, and wrapping it with hfsdp."""
