"""The layout rules, without torch: the strategy names, `LayoutConfig` and its validation, the per-axis placement
table, the geometry of a mesh (`MeshLayout`), the collectives a mesh needs, and the global names of experts.

`validate-config`, `hfsdp plan` (`hfsdp.planning`) and the checkpoint format read these without importing torch;
only `placement.py` (the same table as torch's DTensor placements) imports torch, and `MeshLayout.placements`
imports it on first use. Imports nothing else of hfsdp.
"""
