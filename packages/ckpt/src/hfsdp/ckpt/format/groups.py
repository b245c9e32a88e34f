"""The group structure of a layout, and how it changes when expert parallelism does.

Dense groups are the same in every layout: a unit's parameters of one dtype,
in module order. Expert groups differ by expert-parallel size: on ep rank e a
unit's expert group holds the experts `e*E/ep .. (e+1)*E/ep - 1`. To move to
another ep, the groups of one unit are merged over all ep ranks and split again
by global expert index, in the order the target model would have them: module
order, with experts compared by global index. That order is recovered from the
names alone (see `_module_order`), so the reshard needs no model code.
"""

from __future__ import annotations

from hfsdp.ckpt.format.errors import CheckpointError
from hfsdp.ckpt.format.index import GroupSpec
from hfsdp.core.rules.expert_naming import expert_index


def canonical_groups(reports: list[list[GroupSpec]], ep: int) -> list[GroupSpec]:
    """The structure of the whole model from every rank's own groups (rank order).

    Dense groups come from rank 0 (all ranks hold them); each expert group is
    expanded in place into its `ep` variants, taken from ranks 0..ep-1, which
    are expert-parallel ranks 0..ep-1 (megatron's order, ep index fastest).
    """
    out: list[GroupSpec] = []
    for position, group in enumerate(reports[0]):
        if not group.is_expert:
            out.append(group)
            continue
        out.extend(reports[e][position] for e in range(ep))
    return out


def retarget_groups(groups: list[GroupSpec], num_experts: int | None, target_ep: int) -> list[GroupSpec]:
    """The group structure for `target_ep`: dense groups unchanged, expert groups re-split by global index."""
    source_ep = 1 + max((g.ep_rank or 0 for g in groups if g.is_expert), default=0)
    if source_ep == target_ep:
        return list(groups)
    out: list[GroupSpec] = []
    done: set[tuple[int, str]] = set()
    for group in groups:
        if not group.is_expert:
            out.append(group)
            continue
        key = (group.unit_index, group.dtype)
        if key in done:
            continue
        done.add(key)
        variants = sorted((g for g in groups if g.is_expert and (g.unit_index, g.dtype) == key), key=_ep_rank)
        out.extend(_split(variants, num_experts, target_ep))
    return out


def _ep_rank(group: GroupSpec) -> int:
    return group.ep_rank or 0


def _split(variants: list[GroupSpec], num_experts: int | None, target_ep: int) -> list[GroupSpec]:
    members = [m for g in variants for m in g.members]
    first = variants[0]
    if not num_experts:
        raise CheckpointError(
            f"The checkpoint has expert parameters (e.g. '{members[0][0]}') but its layout records no "
            "num_moe_experts, so they cannot be regrouped for another ep; reshard with the source's ep."
        )
    indices = {}
    for name, _ in members:
        index = expert_index(name)
        if index is None or index >= num_experts:
            raise CheckpointError(
                f"Expert parameter '{name}' has no global expert index below {num_experts} (names must contain "
                "'local_experts.<index>.'), so it cannot be assigned to an expert-parallel rank; reshard with "
                "the source's ep."
            )
        indices[name] = index
    order = _module_order([name for name, _ in members])
    members.sort(key=lambda m: order(m[0]))
    per_rank = num_experts // target_ep
    return [
        GroupSpec(
            first.unit_index,
            True,
            first.dtype,
            e,
            tuple(m for m in members if indices[m[0]] // per_rank == e),
        )
        for e in range(target_ep)
    ]


def _module_order(names: list[str]):
    """A sort key reproducing module order for any subset of `names`.

    Parameters are listed by a depth-first walk of the module tree, children in
    registration order. Walking `names` (already in module order per ep rank)
    records, under every parent path, the order in which children first appear;
    the key of a name is the path of those positions, with expert indices
    compared as numbers. Sorting by it is module order for the target model.
    """
    seen: dict[tuple[str, ...], dict[str, int]] = {}
    for name in names:
        parts = name.split(".")
        for depth, part in enumerate(parts):
            siblings = seen.setdefault(tuple(parts[:depth]), {})
            siblings.setdefault(part, len(siblings))

    def key(name: str) -> tuple[int, ...]:
        parts = name.split(".")
        out = []
        for depth, part in enumerate(parts):
            is_index = depth > 0 and parts[depth - 1] == "local_experts" and part.isdigit()
            out.append(int(part) if is_index else seen[tuple(parts[:depth])][part])
        return tuple(out)

    return key


def merged_order(per_ep_rank: list[list[str]]) -> list[str]:
    """The module order of the ep = 1 model from each ep rank's parameter order (global names)."""
    names = [n for order in per_ep_rank for n in order]
    return sorted(dict.fromkeys(names), key=_module_order(names))


def model_order(index) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor (global name, shape) in the state-dict order of the consolidated (ep = 1) model.

    The index records that order when the save knew it; otherwise the group
    order is the best guess (units first, the root's last), then the unsharded
    module tensors.
    """
    shapes = {n: s for g in index.groups for n, s in g.members}
    shapes.update((n, tuple(t.shape)) for n, t in index.unsharded.items())
    if index.order and set(index.order) == set(shapes):
        return [(n, shapes[n]) for n in index.order]
    grouped = [m for g in retarget_groups(index.groups, index.layout.get("num_moe_experts"), 1) for m in g.members]
    return grouped + [(n, tuple(t.shape)) for n, t in index.unsharded.items()]
