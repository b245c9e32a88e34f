"""The engine state of one sharded module: its units and groups, the step they are in, and the work around
an optimizer's step.

`fully_shard` attaches one `Sharding` to the module it shards (`sharding_of(module)` finds
it); the module's own methods (`module.py`) and the optimizer hooks (`optimizer_hooks.py`)
drive it. The caller names the units (each transformer layer, say); the root takes every
parameter no unit claimed. Inside each unit, parameters are grouped by mesh (dense or
expert) and dtype into `FlatParamGroup`s.

Loss scaling lives here and only here: the reductions are plain sums, and after a step's
last reduction each rank's optimizer piece is multiplied by 1 / (microbatches x the ranks
that reduce), so every layout computes the update of the mean loss over the ranks one step
sums over: the global batch, or with DiLoCo the instance's share of it.

With DiLoCo (`outer_sync.py`) the outer step runs after an inner step's last optimizer has
stepped, every H steps per fragment, before the new weights are published: one publish
carries both.

Gradients ready after a step's last microbatch are consumed by optimizer steps, each of the
pieces it steps (an optimizer over part of the model leaves the rest to another), or all at
once by `zero_grad`. A backward that begins while they are ready and no optimizer consumed
any (gradient accumulation without `set_microbatch`, or a forgotten `step()`) is refused on
every rank: the last microbatch reduced them over all ranks, and nothing can be added to them.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from hfsdp.core.buffers.flat_group import FlatParamGroup, Location
from hfsdp.core.buffers.main_params import MainParam
from hfsdp.core.buffers.mixed_precision import MixedPrecision
from hfsdp.core.buffers.streams import streams_for
from hfsdp.core.engine.dtensor import flat_dtensor
from hfsdp.core.engine.fp8_weights import fp8_gathered_weights
from hfsdp.core.engine.mesh import HybridMeshes
from hfsdp.core.engine.step import Accumulation, StepContext, StepPhase
from hfsdp.core.engine.unit import SHARDING_ATTRIBUTE, ShardedUnit, unit_class
from hfsdp.core.engine.unit_forward import compile_wrapper_message
from hfsdp.core.engine.unit_tree import check_unit_modules, claim_parameters
from hfsdp.core.offload.offload_plan import plan_offload
from hfsdp.core.outer.outer_config import DiLoCoConfig
from hfsdp.core.outer.outer_sync import OuterSync
from hfsdp.core.rules.config import LayoutConfig
from hfsdp.core.rules.expert_naming import ExpertNaming
from hfsdp.core.rules.placement_names import State

ATTRIBUTE = SHARDING_ATTRIBUTE


def is_expert_param_default(name: str, param: nn.Parameter) -> bool:
    """megatron-core marks expert parameters with `allreduce = False`."""
    return getattr(param, "allreduce", True) is False


def sharding_of(module: nn.Module) -> Sharding:
    """The engine state `fully_shard` attached to `module`; a clear error for a module it did not shard."""
    state = module.__dict__.get(ATTRIBUTE)
    if state is None:
        raise TypeError(
            f"{type(module).__name__} was not sharded by hfsdp: call hfsdp.core.engine.module(module, ...) on it "
            "first (and pass the module fully_shard returned)."
        )
    return state


class Sharding:
    def __init__(
        self,
        module: nn.Module,
        config: LayoutConfig,
        meshes: HybridMeshes,
        units: Iterable[nn.Module],
        *,
        mp: MixedPrecision,
        is_expert: Callable[[str, nn.Parameter], bool],
        expert_naming: ExpertNaming | None,
        streams,
        offload: bool | float | str,
        reshard_root_after_forward: bool,
        reshard_after_forward: bool = True,
        diloco: DiLoCoConfig | None = None,
        offload_reserve: int | None = None,
        optimizer_state_bytes: float = 8.0,
        fp8_param_gather: bool = False,
    ):
        self.module, self.config, self.meshes, self.mp = module, config, meshes, mp
        self.expert_naming = expert_naming
        self.device = next(module.parameters()).device
        self._own_streams = streams is None
        self.streams = streams if streams is not None else streams_for(self.device)
        _check_diloco(meshes, diloco, offload)
        _check_meta(self.device, offload, diloco)
        layout = meshes.dense_layout
        outer_axis = len(layout.names) > 1 and not layout.independent_axes()  # DiLoCo's instances never reduce
        self.step = StepContext(layout.reduced_size, self._begin_backward, self._end_backward, outer_axis)
        self.pending: set[str] = set()  # names of ready gradients no optimizer step has consumed yet
        self.consumed = False  # some optimizer stepped since the gradients became ready
        self.weights_pending = False  # `materialize` gave the groups zeros that no load has replaced yet
        units = list(units)
        locations = _locations(module)
        #: the weights gathered in fp8 (`fp8_gather.py`): ids of parameters
        self.fp8_params: set[int] = fp8_gathered_weights(module, units, locations) if fp8_param_gather else set()
        # Each parameter goes to the innermost unit that holds it (`unit_tree.py`); the root takes the rest.
        unit_names = check_unit_modules(module, units)
        unit_params = claim_parameters(module, units, unit_names)
        frozen_params = claim_parameters(module, units, unit_names, trainable=False)
        _check_frozen(frozen_params, diloco)
        unit_modules = [*units, module]
        # Which units keep their fp32 main weights and optimizer state in host memory (offload_plan.py).
        on_device = sum(p.numel() * p.element_size() for p in module.parameters() if p.device.type == "cuda")
        compute_bytes = (mp.param_dtype or torch.float32).itemsize
        self.offload_plan = plan_offload(
            offload,
            [sum(p.numel() for _, p in params) for params in unit_params],
            meshes.dense_layout,
            compute_bytes,
            self.device,
            on_device,
            offload_reserve,
            mp.reduce_dtype.itemsize,
            optimizer_state_bytes,
        )
        self.units: list[ShardedUnit] = []
        for index, (unit_module, params) in enumerate(zip(unit_modules, unit_params, strict=True)):
            is_root = unit_module is module
            groups = self._make_groups(params, locations, is_expert, index, self.offload_plan.units[index])
            groups += self._make_groups(frozen_params[index], locations, is_expert, index, False, frozen=True)
            self.units.append(
                ShardedUnit(
                    unit_module,
                    groups,
                    self.step,
                    reshard_after_forward=reshard_root_after_forward if is_root else reshard_after_forward,
                    input_dtype=mp.param_dtype if is_root else None,
                    before_forward=self.check_before_forward if is_root else None,
                )
            )
            if not is_root:  # the root's class becomes an `HFSDPModule` in `fully_shard`
                unit_module.__class__ = unit_class(type(unit_module))
        # Prefetch in execution order: forward runs root, then the units as given; backward the reverse. The
        # root's backward (the loss and the output layer: the step's largest activations and their gradients)
        # prefetches nothing: the last unit's gather starts when its own backward does, as in FSDP2, so it does
        # not sit on top of the step's memory peak (measured on one H200: 98 MiB of a Llama layer).
        self._unit_places = _places(module, unit_modules[:-1])
        root = self.units[-1]
        order = [root, *self.units[:-1]]
        following = dict(itertools.pairwise(order))
        for earlier, later in itertools.pairwise([None, *order]):
            later.link(following.get(later), earlier if earlier is not root else None)
        self.groups: list[FlatParamGroup] = [g for unit in self.units for g in unit.groups]
        #: The main params, what an optimizer steps; frozen groups' pieces are module parameters too, never stepped.
        self.main_params: list[MainParam] = [p for g in self.groups if not g.frozen for p in g.main_params]
        self.outer: OuterSync | None = OuterSync(diloco, self.groups, len(self.units)) if diloco else None
        #: The ranks a step's scalars (the gradient norm) are reduced over: one instance with DiLoCo, else all.
        apart = meshes.dense_layout.independent_axes()
        self.norm_group = meshes.dense.get_group(meshes.dense_layout.names[-1]) if apart else None

    @property
    def on_meta(self) -> bool:
        """Whether the model was sharded on the meta device and has no real buffers yet (`materialize`)."""
        return self.device.type == "meta"

    def materialize(self, device: torch.device) -> None:
        """Give every group of a model sharded on the meta device real, zero-filled buffers on `device` (and the
        streams of that device); the parameter objects stay the same."""
        self.device = device
        if self._own_streams:
            self.streams = streams_for(device)
        for group in self.groups:
            group.materialize(device, self.streams)
        self.weights_pending = True  # zeros until a state dict or checkpoint is loaded (`republish` clears it)

    @property
    def offload(self) -> bool:
        """Whether any group keeps its main weights and optimizer state in host memory."""
        return any(self.offload_plan.units)

    def _make_groups(
        self, params, locations, is_expert, unit_index: int, offload: bool, frozen: bool = False
    ) -> list[FlatParamGroup]:
        buckets: dict[tuple[bool, torch.dtype, bool], list] = {}
        for name, param in params:
            key = (is_expert(name, param), param.dtype, id(param) in self.fp8_params)
            buckets.setdefault(key, []).append((name, param))
        groups = []
        for (expert, _, fp8), members in buckets.items():
            if expert and self.meshes.expert is None:
                raise ValueError(
                    f"parameter '{members[0][0]}' is an expert parameter but the config has no experts; "
                    "set num_moe_experts (and ep) in the config."
                )
            mesh, layout = (
                (self.meshes.expert, self.meshes.expert_layout)
                if expert
                else (self.meshes.dense, self.meshes.dense_layout)
            )
            naming = self.expert_naming if expert else None
            global_names = [naming.to_global(n) if naming is not None else n for n, _ in members]
            group = FlatParamGroup(
                members,
                global_names,
                [locations[id(p)] for _, p in members],
                mesh,
                layout,
                self.mp,
                is_expert=expert,
                unit_index=unit_index,
                owner=weakref.ref(self),
                streams=self.streams,
                offload=offload,
                frozen=frozen,
                fp8=fp8,
            )
            groups.append(group)
        return groups

    def check_before_forward(self) -> None:
        """Before each forward (the root's): the model is still as it was sharded."""
        self.check_units_in_place()
        self._check_requires_grad()
        if self.weights_pending:
            raise RuntimeError(
                "the model was built on the meta device and given buffers by to_empty(), but no weights were loaded "
                "into them since: it would train from zeros. Load them first: model.load_state_dict(state_dict) or "
                "hfsdp.ckpt.load_checkpoint(dir, model). An initialiser run on the modules after sharding sees only "
                "this rank's pieces of each parameter, so initialise the unsharded model and load its state dict."
            )

    def _check_requires_grad(self) -> None:
        """A parameter frozen or unfrozen after `fully_shard` would be silently ignored: a newly frozen one would go on
        training (its group still reduces gradients for it), a newly unfrozen one would never get a gradient (its
        group is frozen). Refuse it at the next forward."""
        for group in self.groups:
            for piece in group.main_params:
                if piece.param.requires_grad == group.frozen:
                    now = "requires a gradient" if group.frozen else "is frozen"
                    raise RuntimeError(
                        f"parameter '{piece.name}' {now} now but did not when fully_shard sharded it: hfsdp keeps "
                        "frozen parameters in groups of their own (no gradient buffer, no optimizer step), fixed when "
                        "it shards. Set requires_grad before fully_shard (build the model again for another choice)."
                    )

    def check_units_in_place(self) -> None:
        """Before each forward: every unit still sits where it was sharded. A unit replaced after `fully_shard` (by
        `torch.compile(unit)`'s wrapper, say) would run without its parameters gathered or under other names."""
        for parent, key, unit_module, name in self._unit_places:
            if parent._modules.get(key) is not unit_module:
                replaced = parent._modules.get(key)
                if type(replaced).__name__ == "OptimizedModule":
                    raise RuntimeError(compile_wrapper_message(f"unit '{name}'"))
                raise RuntimeError(
                    f"unit '{name}' was replaced after fully_shard (it is now a {type(replaced).__name__}); hfsdp "
                    "gathers the parameters of the modules it sharded. Change the model before calling fully_shard."
                )

    # -- backward ------------------------------------------------------------------------------

    def _begin_backward(self) -> None:
        """Begin a backward: the gradients of a finished step must have been consumed or discarded. A step
        overlapping the forward has been waited for by then unit by unit; waiting here too covers a unit the
        forward skipped, whose gradient buffer the step read and frees only after that wait."""
        self.wait_for_weights()
        if self.step.phase is not StepPhase.GRADS_READY:
            return
        if not self.consumed and _any_rank(self._still_held()):
            shown = ", ".join(sorted(self.pending)[:3]) + (", ..." if len(self.pending) > 3 else "")
            raise RuntimeError(
                "backward() was called again after the last microbatch of a step, before optimizer.step() or "
                "zero_grad(): hfsdp reduced the step's gradients over all ranks on its last microbatch and cannot "
                f"add to them ({len(self.pending)} parameters hold them: {shown}). Call optimizer.step() (or "
                "model.zero_grad()) first, or declare gradient accumulation: model.set_microbatch(index, count) "
                "before each microbatch (hfsdp divides by count), or FSDP2's model.set_requires_gradient_sync(i == "
                "M - 1) with (loss / M).backward()."
            )
        self.zero_grad()

    def _still_held(self) -> bool:
        """Whether this rank still holds unconsumed gradients: a main param's `.grad`, or (where `.grad` is made only
        at the step: another reduce dtype, offload) the buffer."""
        deferred = self.mp.reduce_dtype != torch.float32
        return any(
            ((deferred or g.offload) and g.grads.holds) or any(p.param.grad is not None for p in g.main_params)
            for g in self.groups
        )

    def _end_backward(self) -> None:
        """Finish units autograd did not (the root, unused units), then make compute wait for every reduction
        (on the last microbatch, those over all axes: the optimizer reads the gradients next, through the
        main params' `.grad`)."""
        for unit in reversed(self.units):
            unit.post_backward()
        for group in self.groups:
            group.grads.release()
        if self.step.is_last:
            self._check_in_place(self.main_params)
            for group in self.groups:
                group.expose_grads(group.main_params, copy=False)
            self.pending = {p.name for p in self.main_params}
            self.consumed = False

    # -- around an optimizer's step (optimizer_hooks.py calls these for the pieces it steps) -------------

    def before_step(self, pieces: list[MainParam]) -> None:
        """The last step's weight gathers may still read the main weights the optimizer is about to write;
        the stepped pieces whose gradient needs an fp32 copy (or a host copy) get it now."""
        self._check_in_place(pieces)
        self.wait_for_weights()
        if self.step.phase is StepPhase.ACCUMULATING:
            if self.step.accumulation is Accumulation.SYNC_FLAGS:
                raise RuntimeError(
                    "optimizer.step() was called after a backward with set_requires_gradient_sync(False) (or "
                    "set_requires_all_reduce(False), or inside no_sync()): the gradients are reduced over all ranks "
                    "only by a backward with both set to True. Set them before the last microbatch's backward."
                )
            raise RuntimeError(
                f"optimizer.step() was called after microbatch {self.step.index} of {self.step.count} declared with "
                "set_microbatch: the gradients are reduced over all ranks on the last microbatch only. Step after "
                f"microbatch {self.step.count - 1}, or declare fewer microbatches."
            )
        if self.step.phase is StepPhase.GRADS_READY:
            stepped = self._by_group(pieces)
            for group, mine in stepped:
                group.expose_grads(mine, copy=True)
            for group, _ in stepped:
                group.wait_for_host_grads()  # the host gradients are in before the CPU reads them

    def after_step(self, pieces: list[MainParam]) -> None:
        """Publish the stepped groups' new weights (collective: the next forward's order on every rank) and consume the
        stepped gradients."""
        if self.step.phase is not StepPhase.GRADS_READY:
            return
        stepped = self._by_group(pieces)
        self.consumed = True
        self.pending.difference_update(p.name for p in pieces)
        for group, mine in stepped:
            for piece in mine:
                piece.param.grad = None
            if not any(p.name in self.pending for p in group.main_params):
                group.release_grads()
        done = not self.pending  # the inner step is complete: every optimizer over the model has stepped
        synced = self.outer.inner_step_done() if self.outer is not None and done else []
        for group in self.in_forward_order([*(g for g, _ in stepped), *synced]):
            group.publish_main_weights()
        if done:
            self.step.phase = StepPhase.IDLE

    def in_forward_order(self, groups: Iterable[FlatParamGroup]) -> list[FlatParamGroup]:
        """`groups`, each once, in the next forward's order, the root first (the same on every rank: publishing is
        collective). Each unit's weights then arrive (a gather, or from host memory) before those of the units that
        run after it, so the forward can start on the first."""
        ids = {id(g) for g in groups}
        root = self.units[-1].groups
        return [g for g in [*root, *self.groups[: len(self.groups) - len(root)]] if id(g) in ids]

    def sync_outer(self) -> None:
        """Run the outer step of every fragment not synced since the last optimizer step and republish (collective):
        the global weights everywhere, e.g. before evaluating or exporting the model at the end of a run. The
        schedule is unchanged, and a second call does nothing."""
        if self.outer is None:
            raise RuntimeError(
                "sync_outer() needs a DiLoCo layout (outer strategy 'diloco' and fully_shard(..., diloco=...)); "
                "this model's instances never train apart."
            )
        if self.step.phase is not StepPhase.IDLE:
            raise RuntimeError(
                "sync_outer() was called between a backward and its optimizer step; call it after optimizer.step() "
                "(or zero_grad()), when no gradients are held."
            )
        self.wait_for_weights()
        for group in self.in_forward_order(self.outer.sync()):
            group.publish_main_weights()

    def _by_group(self, pieces: list[MainParam]) -> list[tuple[FlatParamGroup, list[MainParam]]]:
        """`pieces` by their group, in the model's group order (the same on every rank: collectives follow it)."""
        mine: dict[int, list[MainParam]] = {}
        for piece in pieces:
            mine.setdefault(id(piece.group), []).append(piece)
        return [(g, mine[id(g)]) for g in self.groups if id(g) in mine]

    def _check_in_place(self, pieces: list[MainParam]) -> None:
        """A main param moved off the main weights (`.to`, `.double()` on a submodule after sharding) would train
        a copy the model never sees again: refuse it at the next step."""
        for piece in pieces:
            main = piece.group.main
            moved = piece.param.dtype != main.dtype or piece.param.device != main.device
            if moved or (piece.holds and piece.param.data_ptr() != main[piece.offset :].data_ptr()):
                raise RuntimeError(
                    f"parameter '{piece.name}' no longer lives in hfsdp's main weights (it was moved or converted "
                    f"after fully_shard, now {piece.param.dtype} on {piece.param.device}): the optimizer would "
                    "update a copy the model never uses. Choose dtypes with MixedPrecision and move the model to "
                    "its device before calling fully_shard."
                )

    def zero_grad(self) -> None:
        """Free every gradient buffer; the next backward starts a new step's gradients."""
        for group in self.groups:
            group.release_grads()
        self.pending, self.consumed = set(), False
        self.step.phase = StepPhase.IDLE

    def wait_for_weights(self) -> None:
        """Make the current stream wait for the weights the last optimizer step published."""
        for group in self.groups:
            group.wait_for_publish()

    def republish(self) -> None:
        """Derive the compute weights from the main weights again, in every group (collective): after the main
        weights were written outside an optimizer step (a state dict or a checkpoint loaded into them)."""
        for group in self.groups:
            group.publish_main_weights()
        self.weights_pending = False

    # -- sharded views ---------------------------------------------------------------------

    def sharded_buffers(self) -> list[dict[str, DTensor | None]]:
        """Each group's parameter, gradient (None without one) and main-weight pieces as DTensors on its mesh."""
        self.wait_for_weights()
        out = []
        for group in self.groups:
            grad = None
            if group.grads.holds:
                grad_axes = group.layout.sharded_axes(State.GRAD)
                start, stop = group.flat.range_over(grad_axes)
                lo = group.grad_range[0]
                grad = flat_dtensor(group.grads.buffer[start - lo : stop - lo], group, State.GRAD)
            out.append(
                {
                    "param": flat_dtensor(group.compute_shard(), group, State.PARAM),
                    "grad": grad,
                    "main": flat_dtensor(group.master_weights(), group, State.OPTIM),  # fp32, joined if split
                }
            )
        return out

    def state_bytes(self) -> int:
        return sum(g.state_bytes() for g in self.groups)


def _check_meta(device: torch.device, offload, diloco: DiLoCoConfig | None) -> None:
    """A model sharded on the meta device gets its buffers at `to_empty`; offload and DiLoCo plan theirs at once."""
    if device.type != "meta":
        return
    if offload or diloco is not None:
        what = "offload" if offload else "DiLoCo"
        raise ValueError(
            f"the model is on the meta device, and {what} cannot be planned before its buffers exist. Shard it "
            f"without {what}, or materialise it first (model.to_empty(device=...) and load its weights)."
        )


def _check_frozen(frozen_params: list[list], diloco: DiLoCoConfig | None) -> None:
    """Frozen parameters are sharded like the others, but DiLoCo's outer step does not know them yet."""
    frozen = next((name for params in frozen_params for name, _ in params), None)
    if frozen is not None and diloco is not None:
        raise ValueError(
            f"parameter '{frozen}' is frozen (requires_grad=False), and frozen parameters cannot be combined with a "
            "'diloco' outer strategy yet: the outer step would exchange weights that never change. Train DiLoCo "
            "with every parameter trainable, or use another outer strategy."
        )


def _check_diloco(meshes: HybridMeshes, diloco: DiLoCoConfig | None, offload: bool) -> None:
    """A layout whose instances train apart needs DiLoCo's settings, and the settings need such a layout."""
    apart = bool(meshes.dense_layout.independent_axes())
    if apart and diloco is None:
        raise ValueError(
            "the layout's outer strategy is 'diloco', so its instances train apart and meet every H steps, but "
            "fully_shard got no DiLoCo settings; pass diloco=DiLoCoConfig(sync_every=H) (hfsdp.core.DiLoCoConfig)."
        )
    if diloco is not None and not apart:
        raise ValueError(
            "fully_shard got DiLoCo settings (diloco=...), but the layout's outer strategy is not 'diloco': nothing "
            "trains apart to be synced. Set LayoutConfig(outer='diloco', instances=R) or drop diloco=."
        )
    if apart and offload:
        raise ValueError(
            "offload=True cannot be combined with a 'diloco' outer strategy yet: the outer step exchanges the main "
            "weights, which offload keeps in host memory, out of reach of the device's collectives. Train DiLoCo "
            "with the main weights on the device (offload=False)."
        )


def _places(module: nn.Module, units: list[nn.Module]) -> list[tuple[nn.Module, str, nn.Module, str]]:
    """Where each unit sits in `module`: (parent, key, unit, qualified name); a unit outside the tree has none."""
    wanted = {id(u) for u in units}
    places = []
    for parent_name, parent in module.named_modules():
        for key, child in parent._modules.items():
            if child is not None and id(child) in wanted:
                places.append((parent, key, child, f"{parent_name}.{key}" if parent_name else key))
    return places


def _locations(module: nn.Module) -> dict[int, list[Location]]:
    """Every (module, attribute) that holds each parameter, by the parameter's id (a tied parameter has several)."""
    out: dict[int, list[Location]] = {}
    seen: set[tuple[int, str]] = set()
    for sub in module.modules():
        for attr, param in sub._parameters.items():
            if param is not None and (id(sub), attr) not in seen:
                seen.add((id(sub), attr))
                out.setdefault(id(param), []).append((sub, attr))
    return out


def _any_rank(flag: bool) -> bool:
    """Whether `flag` holds on any rank (collective over the world)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    value = torch.tensor(float(flag), device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())
