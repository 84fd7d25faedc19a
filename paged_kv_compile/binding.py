"""How a rewritten attention site finds its layer (and runtime) at call time.

Layer identity is data: `bind` records the storage address of every parameter of every layer. A
compiled site receives its projection weight as a graph input anyway, so the callable the backend
returns looks that address up: blocks can run in any order, be skipped, or share one compiled graph,
and each still reads its own layer's KV. Stand-ins for dense caches are registered here too, so the
backend can recognize them among a graph's example inputs.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable, Sequence

import torch

from .errors import BindingError

#: the runtime a layer is bound to (`runtime.PagedKVRuntime`); only its `config.num_layers` is read here, so this
#: module does not import the runtime (which imports it)
Runtime = Any

#: parameter address -> (runtime, layer index, the bound layer module, the parameter's name in it)
_layer_of_param: dict[int, tuple[weakref.ref, int, weakref.ref, str]] = {}
_standin_storages: dict[int, weakref.ref] = {}
_region_storages: set[int] = set()  # stand-ins of shared write-once regions (a subset of the above)


def bind_layers(runtime: Runtime, layers: Sequence[torch.nn.Module]) -> dict[int, int]:
    """Record each layer's parameters for `runtime`; rejects tied weights and layer-count mismatches."""
    if len(layers) != runtime.config.num_layers:
        raise BindingError(
            f"{len(layers)} layers given but the runtime was configured for {runtime.config.num_layers}; "
            "bind the model's list of blocks/decoder layers"
        )
    table: dict[int, tuple[int, str]] = {}
    for index, layer in enumerate(layers):
        params = list(layer.named_parameters())
        if not params:
            raise BindingError(f"layer {index} ({type(layer).__name__}) has no parameters; bind the attention blocks")
        for name, p in params:
            ptr = p.data_ptr()
            owner = table.get(ptr)
            if owner is not None and owner[0] != index:
                raise BindingError(
                    f"layers {owner[0]} and {index} share a parameter (tied weights): a site could not tell them "
                    "apart; untie the weights (clone them per layer) before binding"
                )
            table[ptr] = (index, name)
    # Validate everything before changing anything: a refused bind leaves every binding as it was.
    for ptr in table:
        previous = _layer_of_param.get(ptr)
        if previous is not None and previous[0]() not in (None, runtime) and _still_held(previous, ptr):
            raise BindingError("these weights are already bound to another live runtime; close it first")
    unbind_runtime(runtime)
    ref = weakref.ref(runtime)
    for ptr, (index, name) in table.items():
        _layer_of_param[ptr] = (ref, index, weakref.ref(layers[index]), name)
    return {ptr: index for ptr, (index, _) in table.items()}


def _still_held(entry: tuple, ptr: int) -> bool:
    """Whether a binding's layer still holds a parameter at `ptr`: otherwise the address was freed or handed to
    another tensor, and the binding is stale (`resolve` would refuse it anyway)."""
    _, _, layer_ref, name = entry
    layer = layer_ref()
    try:
        return layer is not None and layer.get_parameter(name).data_ptr() == ptr
    except AttributeError:
        return False


def unbind_runtime(runtime: Runtime) -> None:
    for ptr in [p for p, (ref, *_) in _layer_of_param.items() if ref() is runtime or ref() is None]:
        del _layer_of_param[ptr]


def resolve(weight: torch.Tensor) -> tuple[Runtime, int]:
    """(runtime, layer index) of a bound parameter; a clear error otherwise."""
    entry = _layer_of_param.get(weight.data_ptr())
    runtime = entry[0]() if entry is not None else None
    if runtime is None:
        raise BindingError(
            f"a paged attention site was called with a weight of shape {tuple(weight.shape)} that no live runtime "
            "has bound: call runtime.bind(layers) with this model's layers (again, if the weights were moved, "
            "re-created or loaded after binding)"
        )
    _, index, layer_ref, name = entry
    # The address alone is not enough: weights swapped between layers (or a new weight that reuses a freed
    # address) would make this site read another layer's KV. The bound layer must still hold this very tensor.
    layer = layer_ref()
    try:
        current = layer.get_parameter(name) if layer is not None else None
    except AttributeError:
        current = None
    if current is not weight:
        raise BindingError(
            f"a paged attention site was called with a weight that was bound as {name!r} of layer {index}, but "
            "that layer no longer holds it (weights swapped, replaced or re-loaded after binding): call "
            "runtime.bind(layers) again with the model's current layers"
        )
    return runtime, index


def register_standin_storage(tensor: torch.Tensor, *, region: bool = False) -> None:
    """`region`: the stand-in of a shared write-once region (read with `paged_kv::attend`, never written)."""
    ptr = tensor.untyped_storage().data_ptr()
    _standin_storages[ptr] = weakref.ref(tensor)
    if region:
        _region_storages.add(ptr)
    else:
        _region_storages.discard(ptr)


def is_standin(value: object) -> bool:
    """True for a view of a registered stand-in storage (see `PagedKVRuntime.standin`)."""
    if not isinstance(value, torch.Tensor) or value.device.type == "meta":
        return False
    try:
        ref = _standin_storages.get(value.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # fake or functional tensors have no real storage
        return False
    return ref is not None and ref() is not None


def is_region_standin(value: object) -> bool:
    """True for a view of a registered region stand-in (see `PagedKVRuntime.region_standin`)."""
    return is_standin(value) and value.untyped_storage().data_ptr() in _region_storages


def registered_layers(runtime: Runtime) -> Iterable[int]:
    return sorted({i for ref, i, *_ in _layer_of_param.values() if ref() is runtime})
