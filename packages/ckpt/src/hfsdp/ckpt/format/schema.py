"""The schema of index.json: every field's type, bounds and known keys, checked in one pass.

An index is read from disk, so until it is checked it is data, not a promise:
a number may be 1e999 or a float where a count belongs, a dtype may be one
hfsdp has never heard of, a file name may lead out of the directory, a layout
may carry keys no LayoutConfig takes. `parse_index` walks the JSON once and
builds a `CheckpointIndex` only from values that passed: integers are whole,
non-negative and fit in int64, numbers are finite, strings are bounded and
printable where they become names, dtypes and keys are known ones, and every
object has exactly the keys the format defines. A problem raises SchemaError
naming the field (`tensors.main['layers.0.up.weight'].pieces[0][2]`); the
reader turns it into a CheckpointError naming the file.

How the fields agree with each other (pieces covering their tensor, every
kind listing the same tensors) is the next gate, `structure.py`.
"""

from __future__ import annotations

from dataclasses import fields as dataclass_fields
from typing import Any

from hfsdp.ckpt.format import fields
from hfsdp.ckpt.format.checksum import UnknownChecksum, split
from hfsdp.ckpt.format.fields import SchemaError
from hfsdp.ckpt.format.index import (
    FORMAT,
    MODEL_FORMATS,
    READABLE_VERSIONS,
    TRANSFORMERS,
    CheckpointIndex,
    FileEntry,
    GroupSpec,
    Piece,
    TensorEntry,
)

#: Layout sizes (world size, experts, batch sizes) above this are not a training job but damage.
MAX_LAYOUT_INT = 2**31 - 1
#: Hyper-parameters a version 1-2 optimizer record may carry.
HYPER_PARAMS = ("lr", "betas", "eps", "weight_decay", "momentum")
#: RNG states kept as tensors in a rank's file.
RNG_KEYS = ("rng/torch_cpu", "rng/torch_cuda")
MT_WORDS = 624  # the Mersenne Twister state of Python's and NumPy's generators
#: A model record's config: at most this many values (a transformers config has ~50, a long id2label some
#: thousands), each string at most MAX_RECORD_TEXT characters.
MAX_RECORD_ITEMS = 1 << 16
MAX_RECORD_TEXT = 1 << 16

TOP_REQUIRED = ("format", "version", "step", "layout", "meshes", "groups", "tensors", "files")
TOP_OPTIONAL = ("extra", "optimizer", "rng", "order", "unsharded", "model", "outer")
#: The outer record's fields: DiLoCo's settings and `inner_steps`, the optimizer steps done (the cycle position);
#: optionally `synced_at`, each fragment's step count at its last outer step (a `sync_outer()` off the schedule).
OUTER_FIELDS = ("strategy", "sync_every", "lr", "momentum", "nesterov", "comm_dtype", "fragments", "inner_steps")


def parse_index(data: Any) -> CheckpointIndex:
    """Check every field of the parsed JSON `data` and build the index from it; raise SchemaError otherwise."""
    top = fields.an_object(data, "the index", TOP_REQUIRED, TOP_OPTIONAL)
    if top["format"] != FORMAT:
        raise SchemaError(
            f"format is {fields.show(top['format'])}, not {FORMAT!r}: this is not an hfsdp checkpoint index"
        )
    version = top["version"]
    if isinstance(version, bool) or not isinstance(version, int) or version not in READABLE_VERSIONS:
        raise SchemaError(
            f"version is {fields.show(version)}, but this hfsdp reads format versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}",
            fix="Read it with the hfsdp release that wrote it, or convert it there.",
        )
    layout = _layout(top["layout"])
    groups = [_group(g, f"groups[{i}]") for i, g in enumerate(fields.a_list(top["groups"], "groups"))]

    def optional(key: str, empty):
        """An optional field: absent or null means empty (older versions lack some); any other value is checked."""
        value = top.get(key)
        return empty if value is None else value

    return CheckpointIndex(
        step=fields.whole(top["step"], "step"),
        layout=layout,
        meshes=_meshes(top["meshes"]),
        extra=_extra(optional("extra", {})),
        optimizer=_optimizer(top.get("optimizer"), groups, version),
        groups=groups,
        tensors={
            fields.state_kind(kind, "tensors"): _entries(entries, f"tensors.{kind}")
            for kind, entries in fields.an_object(top["tensors"], "tensors").items()
        },
        files={
            fields.file_name(name, "files"): _file_entry(entry, f"files[{name!r}]", version)
            for name, entry in fields.an_object(top["files"], "files").items()
        },
        rng={
            _rank(rank): _rng(meta, f"rng[{rank!r}]")
            for rank, meta in fields.an_object(optional("rng", {}), "rng").items()
        },
        order=[fields.text(n, f"order[{i}]") for i, n in enumerate(fields.a_list(optional("order", []), "order"))],
        unsharded=_entries(optional("unsharded", {}), "unsharded"),
        model=parse_model_record(top.get("model")),
        outer=_outer(top.get("outer"), version),
        version=version,
    )


# -- the parts of an index ----------------------------------------------------------------


def _layout(value: Any) -> dict[str, Any]:
    from hfsdp.core.rules.config import ConfigError, LayoutConfig  # torch-free

    optional = tuple(f.name for f in dataclass_fields(LayoutConfig) if f.name != "world_size")
    layout = fields.an_object(value, "layout", ("world_size",), optional)
    for name, item in layout.items():  # LayoutConfig checks the rest; first keep its inputs small
        if isinstance(item, str):
            fields.text(item, f"layout.{name}", 64)
        elif isinstance(item, int) and not isinstance(item, bool):
            fields.whole(item, f"layout.{name}", MAX_LAYOUT_INT)
        elif item is not None:
            raise SchemaError(f"layout.{name} is {fields.kind_of(item)}, where the format has a number, a name or null")
    try:
        LayoutConfig(**layout)
    except ConfigError as err:
        raise SchemaError(f"layout is not a valid layout: {'; '.join(p.message for p in err.problems)}") from None
    return dict(layout)


def _outer(value: Any, version: int) -> dict[str, Any] | None:
    """DiLoCo's record: present exactly in format 4, with valid settings (`DiLoCoConfig`'s rules) and the number of
    optimizer steps done."""
    from hfsdp.core.outer.outer_config import DiLoCoConfig
    from hfsdp.core.rules.config import ConfigError  # torch-free

    if version < 4:
        if value is not None:
            raise SchemaError(f"it has an outer record, which format version {version} does not define")
        return None
    if value is None:
        raise SchemaError("it is format version 4 but has no outer record (DiLoCo's state, which 4 is about)")
    record = fields.an_object(value, "outer", OUTER_FIELDS, ("synced_at",))
    if record["strategy"] != "diloco":
        raise SchemaError(f"outer.strategy is {fields.show(record['strategy'])}, where the format has 'diloco'")
    settings = {k: record[k] for k in OUTER_FIELDS if k not in ("strategy", "inner_steps")}
    for name in ("comm_dtype",):
        fields.text(settings[name], f"outer.{name}", 16)
    for name in ("sync_every", "fragments"):
        fields.whole(settings[name], f"outer.{name}", MAX_LAYOUT_INT)
    for name in ("lr", "momentum"):
        fields.finite(settings[name], f"outer.{name}")
    fields.true_or_false(settings["nesterov"], "outer.nesterov")
    try:
        DiLoCoConfig(**settings)
    except ConfigError as err:
        raise SchemaError(f"outer is not a valid DiLoCo record: {'; '.join(p.message for p in err.problems)}") from None
    steps = fields.whole(record["inner_steps"], "outer.inner_steps")
    out = {**record, "inner_steps": steps}
    if "synced_at" in record:
        out["synced_at"] = _synced_at(record["synced_at"], settings["fragments"], steps)
    return out


def _synced_at(value: Any, fragments: int, steps: int) -> list[int]:
    """`outer.synced_at`: each fragment's step count at its last outer step, none past `inner_steps` (an index
    written before the field existed has none: each fragment's last sync is then its last scheduled one)."""
    if not isinstance(value, list) or len(value) != fragments:
        raise SchemaError(f"outer.synced_at is {fields.show(value)}, where the format has a list of {fragments} steps")
    synced = [fields.whole(v, f"outer.synced_at[{i}]", MAX_LAYOUT_INT) for i, v in enumerate(value)]
    late = next((i for i, v in enumerate(synced) if v > steps), None)
    if late is not None:
        raise SchemaError(
            f"outer.synced_at[{late}] is {synced[late]}, after the {steps} optimizer steps the record says were done"
        )
    return synced


def _meshes(value: Any) -> dict[str, Any]:
    meshes = fields.an_object(value, "meshes", ("dense",), ("expert",))
    out: dict[str, Any] = {"dense": _mesh(meshes["dense"], "meshes.dense", ())}
    out["expert"] = None if meshes.get("expert") is None else _mesh(meshes["expert"], "meshes.expert", ("ep",))
    return out


def _mesh(value: Any, path: str, optional: tuple[str, ...]) -> dict[str, Any]:
    mesh = fields.an_object(value, path, ("names", "shape"), optional)
    out: dict[str, Any] = {
        "names": [
            fields.text(n, f"{path}.names[{i}]", 64)
            for i, n in enumerate(fields.a_list(mesh["names"], f"{path}.names", 8))
        ],
        "shape": list(fields.shape(mesh["shape"], f"{path}.shape")),
    }
    if "ep" in mesh:
        out["ep"] = fields.whole(mesh["ep"], f"{path}.ep", MAX_LAYOUT_INT)
    return out


def _extra(value: Any) -> dict[str, Any]:
    """The caller's free-form dict; only "step", which `load_checkpoint` hands back as the step, is typed."""
    extra = fields.an_object(value, "extra")
    if "step" in extra:
        fields.whole(extra["step"], "extra.step")
    return dict(extra)


def parse_model_record(value: Any) -> dict[str, Any] | None:
    """The model record `{"format", "config"}`: a known format and a bounded JSON object as the config (a
    transformers config names its `model_type`); None when absent. What the config means is the exporter's
    business (`model_record.py`): here it is only data that must stay small and plain."""
    if value is None:
        return None
    record = fields.an_object(value, "model", ("format", "config"), ())
    fmt = record["format"]
    if fmt not in MODEL_FORMATS:
        raise SchemaError(f"model.format is {fields.show(fmt)}, where the format has one of {', '.join(MODEL_FORMATS)}")
    config = fields.an_object(record["config"], "model.config")
    _bounded_tree(config, "model.config")
    if fmt == TRANSFORMERS:
        fields.text(config.get("model_type"), "model.config.model_type", 256)
    return {"format": fmt, "config": config}


def _bounded_tree(value: Any, path: str) -> None:
    """At most MAX_RECORD_ITEMS values below `value`, strings and keys at most MAX_RECORD_TEXT characters (the
    JSON reader already made every number finite and bounded the nesting)."""
    stack, count = [value], 0
    while stack:
        item = stack.pop()
        count += 1
        if count > MAX_RECORD_ITEMS:
            raise SchemaError(f"{path} holds more than {MAX_RECORD_ITEMS} values")
        if isinstance(item, str) and len(item) > MAX_RECORD_TEXT:
            raise SchemaError(f"{path} holds a string of {len(item)} characters, more than {MAX_RECORD_TEXT}")
        if isinstance(item, dict):
            long_key = next((k for k in item if len(k) > MAX_RECORD_TEXT), None)
            if long_key is not None:
                raise SchemaError(f"{path} holds a key of {len(long_key)} characters, more than {MAX_RECORD_TEXT}")
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _optimizer(value: Any, groups: list[GroupSpec], version: int) -> dict[str, Any] | None:
    """The optimizer record (see `optim_state.py`); a version 1-2 record of hfsdp 0.1's own optimizers is read as
    torch's."""
    if value is None:
        return None
    if version < 3:
        return _legacy_optimizer(value, [name for g in groups for name, _ in g.members])
    opt = fields.an_object(value, "optimizer", ("type", "param_groups", "states", "scalars"))
    param_groups = []
    for i, group in enumerate(fields.a_list(opt["param_groups"], "optimizer.param_groups", 1024)):
        path = f"optimizer.param_groups[{i}]"
        group = fields.an_object(group, path, ("hyper", "params"))
        hyper = {
            fields.text(key, f"{path}.hyper", 64): _hyper_value(item, f"{path}.hyper.{key}")
            for key, item in fields.an_object(group["hyper"], f"{path}.hyper").items()
        }
        params = [
            fields.text(n, f"{path}.params[{j}]")
            for j, n in enumerate(fields.a_list(group["params"], f"{path}.params"))
        ]
        param_groups.append({"hyper": hyper, "params": params})
    scalars = {}
    for key, entry in fields.an_object(opt["scalars"], "optimizer.scalars").items():
        path = f"optimizer.scalars.{key}"
        entry = fields.an_object(entry, path, ("tensor", "values"))
        values = {
            fields.text(n, f"{path}.values"): fields.finite(v, f"{path}.values[{n!r}]")
            for n, v in entry["values"].items()
        }
        scalars[fields.text(key, "optimizer.scalars", 64)] = {
            "tensor": fields.true_or_false(entry["tensor"], f"{path}.tensor"),
            "values": values,
        }
    return {
        "type": fields.text(opt["type"], "optimizer.type", 256),
        "param_groups": param_groups,
        "states": [
            fields.state_kind(s, f"optimizer.states[{i}]")
            for i, s in enumerate(fields.a_list(opt["states"], "optimizer.states"))
        ],
        "scalars": scalars,
    }


def _hyper_value(value: Any, path: str) -> Any:
    """A hyper-parameter: a finite number, a bool, a short string, null, or a short list of numbers."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return fields.text(value, path, 256)
    if isinstance(value, list):
        return [fields.finite(v, f"{path}[{i}]") for i, v in enumerate(fields.a_list(value, path, 16))]
    return fields.finite(value, path)


#: hfsdp 0.1's own optimizers and the torch optimizers with the same arithmetic and state names.
LEGACY_OPTIMIZERS = {"ShardedAdamW": "AdamW", "ShardedSGD": "SGD"}


def _legacy_optimizer(value: Any, names: list[str]) -> dict[str, Any]:
    """A version 1-2 record ({type, step_count, hyper, states}) as the torch optimizer's record: one parameter
    group of every parameter with the saved hyper-parameters, AdamW's `step` = the step count for each."""
    opt = fields.an_object(value, "optimizer", ("type", "step_count", "hyper", "states"))
    legacy_type = fields.text(opt["type"], "optimizer.type", 256)
    if legacy_type not in LEGACY_OPTIMIZERS:
        raise SchemaError(f"optimizer.type is {fields.show(legacy_type)}, which format versions 1 and 2 never wrote")
    hyper = fields.an_object(opt["hyper"], "optimizer.hyper", (), HYPER_PARAMS)
    checked: dict[str, Any] = {}
    for name, item in hyper.items():
        path = f"optimizer.hyper.{name}"
        if name == "betas":
            checked[name] = [
                fields.finite(b, f"{path}[{i}]") for i, b in enumerate(fields.a_list(item, path, 2, exact=True))
            ]
        else:
            checked[name] = fields.finite(item, path)
    step = fields.whole(opt["step_count"], "optimizer.step_count")
    states = [
        fields.state_kind(s, f"optimizer.states[{i}]")
        for i, s in enumerate(fields.a_list(opt["states"], "optimizer.states"))
    ]
    adamw = legacy_type == "ShardedAdamW"
    scalars = {"step": {"tensor": True, "values": dict.fromkeys(names, float(step))}} if adamw and step else {}
    return {
        "type": LEGACY_OPTIMIZERS[legacy_type],
        "param_groups": [{"hyper": checked, "params": list(names)}],
        "states": states if step else [],
        "scalars": scalars,
    }


def _group(value: Any, path: str) -> GroupSpec:
    group = fields.an_object(value, path, ("unit_index", "is_expert", "dtype", "ep_rank", "members"))
    members = []
    for i, member in enumerate(fields.a_list(group["members"], f"{path}.members")):
        name, shape = fields.a_list(member, f"{path}.members[{i}]", 2, exact=True)
        members.append((fields.text(name, f"{path}.members[{i}][0]"), fields.shape(shape, f"{path}.members[{i}][1]")))
    ep_rank = group["ep_rank"]
    return GroupSpec(
        fields.whole(group["unit_index"], f"{path}.unit_index"),
        fields.true_or_false(group["is_expert"], f"{path}.is_expert"),
        fields.dtype(group["dtype"], f"{path}.dtype"),
        None if ep_rank is None else fields.whole(ep_rank, f"{path}.ep_rank", MAX_LAYOUT_INT),
        tuple(members),
    )


def _entries(value: Any, path: str) -> dict[str, TensorEntry]:
    out = {}
    for name, entry in fields.an_object(value, path).items():
        where = f"{path}[{fields.text(name, path)!r}]"
        tensor = fields.an_object(entry, where, ("shape", "dtype", "pieces"))
        pieces = []
        for i, piece in enumerate(fields.a_list(tensor["pieces"], f"{where}.pieces")):
            at = f"{where}.pieces[{i}]"
            file, key, start, stop = fields.a_list(piece, at, 4, exact=True)
            pieces.append(
                Piece(
                    fields.file_name(file, f"{at}[0]"),
                    fields.text(key, f"{at}[1]"),
                    fields.whole(start, f"{at}[2]"),
                    fields.whole(stop, f"{at}[3]"),
                )
            )
        out[name] = TensorEntry(
            fields.shape(tensor["shape"], f"{where}.shape"), fields.dtype(tensor["dtype"], f"{where}.dtype"), pieces
        )
    return out


def _file_entry(value: Any, path: str, version: int) -> FileEntry:
    if version == 1:  # hfsdp 0.1 wrote bare sha256 digests
        entry = fields.an_object(value, path, ("sha256", "bytes"))
        checksum = f"sha256:{fields.text(entry['sha256'], f'{path}.sha256', 64)}"
    else:
        entry = fields.an_object(value, path, ("checksum", "bytes"))
        checksum = fields.text(entry["checksum"], f"{path}.checksum", 128)
    try:
        split(checksum)
    except UnknownChecksum as err:
        raise SchemaError(f"{path}: {err}") from None
    return FileEntry(checksum, fields.whole(entry["bytes"], f"{path}.bytes"))


def _rank(value: str) -> str:
    if not (value.isascii() and value.isdigit()) or len(value) > 10 or (len(value) > 1 and value[0] == "0"):
        raise SchemaError(f"rng has the key {fields.show(value)}, which is not a rank number")
    return value


def _rng(value: Any, path: str) -> dict[str, Any]:
    """One rank's RNG record: its file and tensor keys, and Python's (and NumPy's) generator state."""
    meta = fields.an_object(value, path, ("file", "keys", "python"), ("numpy",))
    keys = [
        fields.text(k, f"{path}.keys[{i}]", 64) for i, k in enumerate(fields.a_list(meta["keys"], f"{path}.keys", 8))
    ]
    for key in keys:
        if key not in RNG_KEYS:
            raise SchemaError(
                f"{path}.keys lists {key!r}, which is not an RNG state hfsdp saves ({', '.join(RNG_KEYS)})"
            )
    if len(set(keys)) != len(keys):
        raise SchemaError(f"{path}.keys lists a key twice")
    out = {
        "file": fields.file_name(meta["file"], f"{path}.file"),
        "keys": keys,
        "python": _python_state(meta["python"], path),
    }
    if "numpy" in meta:
        out["numpy"] = _numpy_state(meta["numpy"], path)
    return out


def _python_state(value: Any, path: str) -> list:
    """[version 3, 624 words and a position, gauss_next]: what `random.setstate` takes."""
    where = f"{path}.python"
    version, state, gauss = fields.a_list(value, where, 3, exact=True)
    if version != 3 or isinstance(version, bool):
        raise SchemaError(f"{where}[0] is {fields.show(version)}, but Python's generator state has version 3")
    words = _mt_state(state, f"{where}[1]", MT_WORDS + 1)
    if words[-1] > MT_WORDS:
        raise SchemaError(f"{where}[1][{MT_WORDS}] is {words[-1]}, but the position in the state is at most {MT_WORDS}")
    return [3, words, None if gauss is None else fields.finite(gauss, f"{where}[2]")]


def _numpy_state(value: Any, path: str) -> list:
    """[624 words, position, has_gauss, cached_gaussian]: NumPy's legacy global MT19937 generator."""
    where = f"{path}.numpy"
    words, position, has_gauss, cached = fields.a_list(value, where, 4, exact=True)
    return [
        _mt_state(words, f"{where}[0]", MT_WORDS),
        fields.whole(position, f"{where}[1]", MT_WORDS),
        fields.whole(has_gauss, f"{where}[2]", 1),
        fields.finite(cached, f"{where}[3]"),
    ]


def _mt_state(value: Any, path: str, length: int) -> list[int]:
    return [
        fields.whole(w, f"{path}[{i}]", 2**32 - 1) for i, w in enumerate(fields.a_list(value, path, length, exact=True))
    ]
