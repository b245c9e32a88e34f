"""The machines a plan is for, and which link each mesh axis runs on.

Ranks are numbered node by node (what torchrun does), and the dense mesh is
`arange(D).reshape(R, N)`: an axis whose group of ranks fits inside one node runs on the
node's links (NVLink), one that spans nodes is held to the network, each rank sending
through its own NIC. The defaults describe an 8 x H200 node (NVLink 4: 900 GB/s per GPU in
both directions together, so 450 GB/s each way; 141 GB of HBM3e; 989 dense bf16 TFLOP/s)
with 400 Gb/s per GPU between nodes. These are the vendors' figures, not measurements:
achieved bandwidths are lower, and communication times built on them are unvalidated
(docs/planning.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from hfsdp.core.rules.layout import MeshLayout

INTRA, INTER = "intra-node", "inter-node"
#: Dense peak TFLOP/s of one H200 by compute dtype (NVIDIA's figures: bf16 tensor cores; fp32 without TF32, which
#: torch leaves off for matmuls by default).
H200_PEAK_TFLOPS = {"bf16": 989.0, "fp32": 67.0}


@dataclass(frozen=True)
class Cluster:
    nodes: int = 1
    gpus_per_node: int = 8
    gpu_memory_gib: float = 141e9 / 2**30  # 141 GB
    intra_gbps: float = 450.0  # GB/s each way per GPU (NVLink)
    inter_gbps: float = 50.0  # GB/s per GPU between nodes (400 Gb/s)
    peak_tflops: float = H200_PEAK_TFLOPS["bf16"]

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def gpu_memory_bytes(self) -> int:
        return int(self.gpu_memory_gib * 2**30)

    def link(self, layout: MeshLayout, axis: int, rank_stride: int = 1) -> str:
        """The link an axis's collectives are held to: inside one node, or across nodes.

        On a row-major mesh every group along `axis` lies in a block of `rank_stride` x (the sizes
        of that axis and the later ones) consecutive ranks; the groups stay inside nodes when such
        blocks tile the nodes. `rank_stride` is the expert-parallel size for the expert mesh, whose
        ranks interleave with the expert-parallel index (`hfsdp.core.engine.mesh.build_mesh`).
        """
        block = rank_stride
        for a in layout.axes[axis:]:
            block *= a.size
        return INTRA if block <= self.gpus_per_node and self.gpus_per_node % block == 0 else INTER

    def bandwidth(self, link: str) -> float:
        """Bytes per second one rank sends on `link`."""
        return (self.intra_gbps if link == INTRA else self.inter_gbps) * 1e9
