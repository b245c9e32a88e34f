"""hfsdp.recipes.prepare: text to the Megatron indexed dataset `hfsdp train --data-path` and megatron-core read.

One concept per module, in the order a run uses them:

- `sources`: which inputs are read how (JSON Lines, text, parquet), batches of raw lines, what a line means;
- `tokenizer`: the transformers tokenizer, loaded once in the parent; its backend is what the workers run;
- `workers`, `encode`: spawned processes tokenizing batches in order, one each in flight, signal-safe;
- `pieces`: a long document tokenized piece by piece, cut where the tokenizer splits anyway (same ids);
- `indexed_writer`: the `.bin/.idx` format from its specification, streamed in bounded memory;
- `output`, `signals`: staging beside the prefix, renamed into place, nothing half-written on any failure;
- `sidecar`: `PREFIX.meta.json`, which tokenizer made the data, read by `hfsdp train` before launch;
- `pipeline`: `prepare(Request)`, the whole run, and its `Summary`.

Nothing here imports torch or megatron-core (transformers, in the parent only, imports torch itself).
"""
