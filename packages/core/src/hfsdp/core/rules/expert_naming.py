"""Local and global names of expert parameters.

With expert parallelism each rank holds `num_experts / ep` experts and names them
by local index (megatron-core: `...experts.local_experts.{j}...`). The global
name is the one the parameter would have with ep = 1, i.e. in the consolidated
model: local index j on expert-parallel rank e is global expert
`e * num_experts / ep + j`. Checkpoints store global names, which is what lets
them move between ep sizes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

EXPERT_INDEX = re.compile(r"(local_experts\.)(\d+)(\.)")


@dataclass(frozen=True)
class ExpertNaming:
    num_experts: int
    ep: int
    ep_rank: int

    @property
    def local_count(self) -> int:
        return self.num_experts // self.ep

    def to_global(self, name: str) -> str:
        return EXPERT_INDEX.sub(lambda m: f"{m[1]}{self.ep_rank * self.local_count + int(m[2])}{m[3]}", name, count=1)

    def to_local(self, name: str) -> str:
        return EXPERT_INDEX.sub(lambda m: f"{m[1]}{int(m[2]) - self.ep_rank * self.local_count}{m[3]}", name, count=1)

    def owns(self, global_name: str) -> bool:
        """Whether this expert-parallel rank holds the expert `global_name` belongs to."""
        index = expert_index(global_name)
        return index is not None and index // self.local_count == self.ep_rank


def expert_index(name: str) -> int | None:
    """The expert index in `name`, or None for a parameter that is not an expert's."""
    match = EXPERT_INDEX.search(name)
    return int(match[2]) if match else None
