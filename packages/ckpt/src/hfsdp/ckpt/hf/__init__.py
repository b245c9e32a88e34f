"""Hugging Face interop: a `save_pretrained` directory read as untrusted input, mixture-of-experts tensors
as transformers stores them, the import of such a directory as a checkpoint of any layout, and what an
export in Hugging Face format writes."""
