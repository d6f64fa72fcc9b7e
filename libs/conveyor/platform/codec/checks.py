"""Field checks that name the culprit: the slow path behind the plans' one-comparison type
checks, and the walk over plain values that decode would refuse."""

from __future__ import annotations

import sys
from operator import countOf
from typing import Any

from conveyor.platform.codec.errors import MalformedMessage
from conveyor.platform.codec.plans import _Plan
from conveyor.platform.messages import FieldKind

_MAX_NESTING = 32
_PLAIN_LEAVES = (type(None), bool, int, float, str, bytes)


def _check_types(plan: _Plan, values: tuple[Any, ...], *, decoding: bool) -> None:
    """The slow path, when some value is not of its field's common type: check each value
    against its spec, raising MalformedMessage that names the first misfit."""
    for (spec, where), value in zip(plan.type_specs, values, strict=True):
        if spec.kind is FieldKind.VALUE:
            if spec.types is not None and type(value) not in spec.types:
                allowed = " | ".join(sorted(t.__name__ for t in spec.types))
                raise MalformedMessage(f"{where}: expected {allowed}, got {type(value).__name__}")
        elif spec.kind is FieldKind.TENSOR_DICT:
            _check_str_dict(where, value)
        elif spec.kind in (FieldKind.RECORD, FieldKind.RECORD_LIST):
            pass  # checked as a whole by the records module
        elif not decoding and not _is_tensor(value):
            raise MalformedMessage(f"{where}: expected a tensor, got {type(value).__name__}")
        # A decoded tensor field holds a descriptor, checked by _PayloadReader.read.


def _check_items(where: str, values: Any, item_types: frozenset[type]) -> None:
    # Runs in C: a few microseconds for hundreds of sample ids.
    if len(item_types) == 1:
        (item_type,) = item_types
        ok = countOf(map(type, values), item_type) == len(values)
    else:
        ok = item_types.issuperset(map(type, values))
    if not ok:
        allowed = " | ".join(sorted(t.__name__ for t in item_types))
        raise MalformedMessage(f"{where}: items must be {allowed}")


def _check_str_dict(where: str, value: object) -> None:
    if type(value) is not dict:
        raise MalformedMessage(f"{where}: expected a dict, got {type(value).__name__}")
    if countOf(map(type, value), str) != len(value):
        raise MalformedMessage(f"{where}: dict keys must be str")


def _check_plain(where: str, value: object, depth: int) -> None:
    """On encode: ``value`` must hold only plain values, with str keys (what decode accepts)."""
    if depth > _MAX_NESTING:
        raise MalformedMessage(f"{where}: nested deeper than {_MAX_NESTING}")
    if isinstance(value, _PLAIN_LEAVES):
        return
    if isinstance(value, list | tuple):
        for item in value:
            _check_plain(where, item, depth + 1)
    elif isinstance(value, dict):
        _check_str_dict(where, value)
        for item in value.values():
            _check_plain(where, item, depth + 1)
    elif _is_tensor(value):
        raise MalformedMessage(f"{where}: tensors go in Tensor or dict[str, Tensor] fields")
    else:
        raise MalformedMessage(f"{where}: cannot send a {type(value).__name__}")


def _is_tensor(value: object) -> bool:
    """Whether ``value`` is what a tensor field takes: a torch tensor or a numpy array. Asked
    without importing either: no tensor (array) exists in a process that has not imported
    torch (numpy), and these checks run in processes that never do."""
    torch, numpy = sys.modules.get("torch"), sys.modules.get("numpy")
    return (torch is not None and isinstance(value, torch.Tensor)) or (
        numpy is not None and isinstance(value, numpy.ndarray)
    )
