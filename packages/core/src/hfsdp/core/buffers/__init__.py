"""One group of parameters as flat sharded buffers: the flat layout of its slots, its collectives over the mesh
axes, the parameter side (`flat_group`: main weights, compute shard, gathered buffer, publishing), the gradient side
(`grad_buffer`), the main params an optimizer steps, streams and mixed precision.

May import `rules` and `offload`.
"""
