"""hfsdp.planning: which layout for this model on this cluster, in closed form, without torch.

The planner predicts, for every layout, the memory one rank needs (parameters, gradients,
optimizer state, communication buffers, activations), the bytes each mesh axis carries per
optimizer step, and the step time given the engine's overlap of communication with compute.
Its layout arithmetic is the engine's own: the placement names (`hfsdp.core.rules.placement_names`),
`MeshLayout` (shard factors, padding) and the collective plan (`hfsdp.core.rules.comm_plan.plan_for`),
applied to the same parameter groups `FlatParamGroup` builds (one per unit, mesh and dtype).
The models behind each number and their measured error are in docs/planning.md.

Modules, one concept each:

| module | concept |
|---|---|
| `model_shape.py` | a model as the planner sees it: per-unit parameter counts and the sizes activations follow |
| `gpt_shape.py`, `hf_shape.py` | closed-form parameter counts of the megatron-core GPT and the Hugging Face families |
| `groups.py` | the engine's parameter groups of a model on a layout, with their padded geometry |
| `traffic.py` | every collective one optimizer step issues, and the bytes per axis |
| `activations.py` | bytes of activations a microbatch keeps for backward, and its loss's peak |
| `memory.py` | per-rank memory at the step's peak, split by kind |
| `timing.py` | compute time and the overlap of communication with it (a small stream simulation) |
| `cluster.py` | the machines: memory, links, FLOP rate; which link each mesh axis runs on |
| `candidates.py` | every layout worth considering, each evaluated, and the recommendation |
"""
