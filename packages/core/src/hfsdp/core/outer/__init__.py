"""DiLoCo on the outer axis: its settings (`outer_config`, torch-free), what the exchange sends (`outer_codec`),
and the outer step over every group (`outer_sync`).

May import `rules` and `buffers`.
"""
