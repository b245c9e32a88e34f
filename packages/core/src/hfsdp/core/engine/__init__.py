"""The sharded module: meshes, units and their hooks, the step's phases, `Sharding` (the engine state of a module),
`fully_shard` and the module contract, the optimizer step hooks, clipping, state dicts, parameter groups,
recomputation and compilation of a unit's forward, DTensor views.

May import `rules`, `offload`, `buffers` and `outer`.
"""
