"""The on-disk format, without torch: the index and its schema, safetensors headers, checksums, names that
stay inside the directory, the store of published steps, staging, and `verify` / `inspect`.

Every reader passes one gate here first (bounded JSON, then the schema, then the structure), so nothing
later trusts a byte it did not check. Also the pure arithmetic of who holds and writes which flat range
(`pieces`, `groups`). Importing this subpackage never imports torch.
"""
