"""The megatron-core models and interop: process groups, the GPT, the CPU shim, and sharding it with hfsdp."""
