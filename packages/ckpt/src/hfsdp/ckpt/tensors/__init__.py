"""Flat ranges of tensors in and out of safetensors files (torch): a streaming writer that hashes on the
way out, a reader of any range through lazy slices, and the writing of a whole layout's files from any
source of ranges, which save, reshard, import and export share."""
