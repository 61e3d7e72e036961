"""Device meshes and the one rule table that maps logical axis names to mesh axes.

Every parameter carries logical axis names (`out_sharding` metadata, see `layers.param`), and so does
every cache buffer (`cache.CACHE_AXES`). `RULES` says which mesh axis each logical axis is split over:
tensor parallelism over attention heads, kv heads, the MLP width and the vocabulary ("model"), data
parallelism over the batch ("data"), and optionally fully-sharded parameters over the model width
("fsdp", which also splits the batch). A mesh axis of size 1 is simply unused, so one table serves one
device and a pod slice alike.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from clover_jax.model.cache import CACHE_AXES, KVCache
from clover_jax.errors import CloverError

MESH_AXES = ("data", "fsdp", "model")

# logical axis -> mesh axes it is split over (None: replicated along it).
RULES: dict[str, tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "vocab": ("model",),
    "embed": ("fsdp",),
    "embed_out": None,
    "heads": ("model",),
    "kv_heads": ("model",),
    "mlp": ("model",),
    "length": None,
    "head_dim": None,
    "qkv": None,  # a kv head's query heads, key and value (`layers.QKVProjection`): kept together
    "layers": None,
}


def parse_mesh(spec: str | None) -> dict[str, int]:
    """'data=2,model=4' -> {'data': 2, 'model': 4}; None or '' -> every device on 'data'. One axis may be
    -1: the devices the others leave (`make_mesh` works it out)."""
    if not spec:
        return {"data": jax.device_count()}
    sizes: dict[str, int] = {}
    for part in spec.split(","):
        name, sep, value = part.strip().partition("=")
        if not sep or name not in MESH_AXES:
            raise CloverError(f"mesh={spec!r}: write axis=size pairs such as data=2,model=4 "
                              f"(axes: {', '.join(MESH_AXES)})", arguments=("mesh",))
        try:
            size = int(value)
        except ValueError:
            raise CloverError(f"mesh={spec!r}: {name} size {value!r} is not an integer",
                              arguments=("mesh",)) from None
        if (size < 1 and size != -1) or name in sizes:
            raise CloverError(f"mesh={spec!r}: each axis once, with a size >= 1 (or -1 for the rest)",
                              arguments=("mesh",))
        sizes[name] = size
    if list(sizes.values()).count(-1) > 1:
        raise CloverError(f"mesh={spec!r}: only one axis can be -1 (the devices the others leave)",
                          arguments=("mesh",))
    return sizes


def make_mesh(spec: str | dict[str, int] | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh over `devices` (default: all, every process's) with axes data, fsdp, model in that order.

    Sizes whose product is smaller than the device count take the first that many devices (`mesh.size`
    says how many); an axis of -1 takes what the others leave, so their product must divide the count."""
    sizes = parse_mesh(spec) if not isinstance(spec, dict) else dict(spec)
    devices = list(devices if devices is not None else jax.devices())
    fixed = math.prod(v for v in sizes.values() if v != -1)
    rest = [k for k, v in sizes.items() if v == -1]
    if rest:
        if len(devices) % fixed:
            raise CloverError(f"mesh {format_mesh(sizes)}: the other axes ({fixed} devices) do not divide the "
                              f"{len(devices)} devices, so -1 has no size; pick sizes that divide {len(devices)}")
        sizes[rest[0]] = len(devices) // fixed
    total = math.prod(sizes.values())
    if total > len(devices):
        raise CloverError(f"mesh {format_mesh(sizes)} needs {total} devices, but {len(devices)} are available; "
                          "make the sizes multiply to at most the device count")
    if total < len(devices) and jax.process_count() > 1:
        raise CloverError(f"mesh {format_mesh(sizes)} uses {total} of {len(devices)} devices; over several "
                          "processes a mesh takes every device (make the sizes multiply to the count, or use -1)")
    shape = tuple(sizes.get(a, 1) for a in MESH_AXES)
    return Mesh(np.array(devices[:total]).reshape(shape), MESH_AXES)


def describe_mesh(mesh: Mesh) -> str:
    """`data=2,model=4 on 8 of 8 devices`: the mesh's axes over 1 (its sizes as --mesh takes them) and how
    many of the devices there are it runs on."""
    sizes = {a: n for a, n in mesh.shape.items() if n > 1} or {MESH_AXES[0]: 1}
    return f"{format_mesh(sizes)} on {mesh.size} of {jax.device_count()} devices"


def format_mesh(sizes: dict[str, int]) -> str:
    """`{"data": 2, "model": 4}` -> `data=2,model=4`, the form --mesh takes."""
    return ",".join(f"{k}={v}" for k, v in sizes.items())


def spec_for(axes: Sequence[str | None] | None, shape: Sequence[int], mesh: Mesh, what: str = "array") -> PartitionSpec:
    """The PartitionSpec of an array with logical `axes`, checking that every split divides evenly."""
    if axes is None:
        return PartitionSpec()
    if len(axes) != len(shape):
        raise CloverError(f"{what}: {len(axes)} axis names {tuple(axes)} for a {len(shape)}-d array")
    parts, used = [], set()
    for name, dim in zip(axes, shape):
        mesh_axes = tuple(a for a in (RULES.get(name) or ()) if mesh.shape[a] > 1 and a not in used)
        n = math.prod(mesh.shape[a] for a in mesh_axes)
        if dim % n:
            raise CloverError(
                f"{what}: its {name} axis ({dim}) does not divide over mesh axes "
                f"{'x'.join(f'{a}={mesh.shape[a]}' for a in mesh_axes)}; pick a mesh whose sizes divide it")
        used.update(mesh_axes)
        parts.append(mesh_axes[0] if len(mesh_axes) == 1 else (mesh_axes or None))
    return PartitionSpec(*parts)


def param_sharding(path, var, mesh: Mesh) -> NamedSharding:
    """Where one parameter (an nnx Variable with `out_sharding` axis names) lives on `mesh`."""
    value = var.get_value()
    name = ".".join(str(p) for p in path)
    return NamedSharding(mesh, spec_for(var.get_metadata().get("out_sharding"), value.shape, mesh, name))


def shard_module(module: nnx.Module, mesh: Mesh) -> nnx.Module:
    """Move every parameter of `module` onto its shards (in place; returns the module)."""
    place = lambda path, var: var.replace(jax.device_put(var.get_value(), param_sharding(path, var, mesh)))
    nnx.update(module, nnx.map_state(place, nnx.state(module, nnx.Param)))
    return module


def onto_mesh(tree, mesh: Mesh):
    """Replicate over `mesh` every array of `tree` that is not on it yet (an optimizer's step count, a
    scalar orbax restored to one device), so one jitted step can take them all."""
    devices = set(mesh.devices.flat)
    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(lambda x: x if set(x.sharding.device_set) == devices else jax.device_put(x, replicated), tree)


def replicate(tree, mesh: Mesh):
    """Inside a jitted program: every array of `tree` whole on every device of `mesh`."""
    everywhere = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, everywhere), tree)


def constrain_cache(cache: KVCache, mesh: Mesh | None) -> KVCache:
    """Pin a cache built inside a jitted program to its shards (batch over data, kv heads over model)."""
    if mesh is None or cache is None:
        return cache
    s = NamedSharding(mesh, spec_for(CACHE_AXES, cache.k[0].shape, mesh, "KV cache"))
    pin = lambda bufs: tuple(jax.lax.with_sharding_constraint(x, s) for x in bufs)
    return cache.replace(k=pin(cache.k), v=pin(cache.v))


def batch_split(mesh: Mesh | None) -> int:
    """How many ways `mesh` splits a batch (data x fsdp; 1 without a mesh): a batch must be a multiple of it."""
    return 1 if mesh is None else math.prod(mesh.shape[a] for a in RULES["batch"])


def put_batch(x, mesh: Mesh) -> jax.Array:
    """A host array with a leading batch axis as one global array split over data (and fsdp), the rest
    replicated. Every process holds the whole (small) array; each device takes its own rows."""
    x = np.asarray(x)
    sharding = NamedSharding(mesh, spec_for(("batch",) + (None,) * (x.ndim - 1), x.shape, mesh, "batch"))
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
