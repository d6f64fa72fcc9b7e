"""The message registry: the :class:`Message` base class, the :func:`message` decorator that
registers a schema under its wire name and version, and the :class:`FieldSpec` each field
annotation becomes for the codec to check values against."""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar, TypeVar

ENVELOPE_KEYS = frozenset({"v", "type"})
"""Header keys the envelope uses; no field may take these names."""


@dataclass(kw_only=True, slots=True)
class Message:
    """Base of every wire message; subclasses are registered with :func:`message`.

    The generated ``__eq__`` compares fields as a tuple, which raises for multi-element
    tensors: compare tensor-carrying messages field by field (``torch.equal``).
    """

    TYPE: ClassVar[str]
    """Wire name, set by :func:`message`."""
    VERSION: ClassVar[int]
    """Schema version, set by :func:`message`."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Record:
    """Base of a typed row nested in a message field (``Row`` or ``list[Row]``): a frozen,
    kw-only, slotted dataclass of plain-value fields (no tensors, no nested records). It
    travels as a msgpack map of its fields and decodes back to its class, with the same type
    checks as a message's fields and its own ``__post_init__`` checks."""


class TensorAnnotation:
    """What the name ``Tensor`` in a field annotation resolves to when a schema registers.

    Schema modules import ``Tensor`` from torch under ``TYPE_CHECKING`` only: the registry,
    and so every service, then loads without torch (~2.5 CPU-s of imports), and a process
    imports torch only when it first encodes or decodes a tensor (the codec's
    :mod:`~conveyor.platform.codec.tensors`). An annotation that is ``torch.Tensor`` itself (a
    module without ``from __future__ import annotations``) is a tensor field too."""


_ANNOTATION_NAMES: dict[str, Any] = {"Tensor": TensorAnnotation}
"""Names a field annotation may use that its module imports for type checkers only."""


class FieldKind(Enum):
    """How a field travels on the wire."""

    VALUE = "value"
    """A plain msgpack value inside the header."""
    RECORD = "record"
    """One :class:`Record`, a map inside the header."""
    RECORD_LIST = "record_list"
    """A list of :class:`Record` s of one class, maps inside the header."""
    TENSOR = "tensor"
    """One tensor, its bytes after the header."""
    TENSOR_DICT = "tensor_dict"
    """A ``dict[str, Tensor]``, each tensor's bytes after the header."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FieldSpec:
    """What the codec checks for one field, derived from its annotation."""

    name: str
    """Field name, also its key in the wire header."""
    kind: FieldKind
    """How it travels."""
    types: frozenset[type] | None = None
    """Exact Python types the value may have (``type(v) in types``); None: any plain value."""
    item_types: frozenset[type] | None = None
    """Exact types of a list's items or a dict's values; None: not checked item by item."""
    nested: bool = False
    """The value may hold containers of unchecked content, walked on encode."""
    record: type[Record] | None = None
    """The record class of a RECORD or RECORD_LIST field."""
    record_fields: tuple[FieldSpec, ...] = ()
    """The specs of the record's own fields (plain values only)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MessageSchema:
    """A registered message class with its wire name, version and field specs."""

    cls: type[Message]
    name: str
    version: int
    fields: tuple[FieldSpec, ...]


_REGISTRY: dict[str, MessageSchema] = {}

M = TypeVar("M", bound=Message)


def message(name: str, version: int) -> Callable[[type[M]], type[M]]:
    """Class decorator: register a message class under wire ``name`` with schema ``version``.

    Raises ValueError for a taken name, a version < 1, a class that is not a kw-only slotted
    dataclass subclass of :class:`Message`, or a field named like an envelope key; TypeError
    for a field annotation the codec cannot carry.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"message name must be a non-empty string, got {name!r}")
    if type(version) is not int or version < 1:
        raise ValueError(f"message version must be an int >= 1, got {version!r}")

    def register(cls: type[M]) -> type[M]:
        if name in _REGISTRY:
            raise ValueError(f"message name {name!r} is already taken by {_REGISTRY[name].cls}")
        if not issubclass(cls, Message):
            raise ValueError(f"{cls.__qualname__} must subclass Message")
        # Checked on the class itself: a subclass inherits its parent's dataclass markers.
        if "__dataclass_fields__" not in cls.__dict__ or "__slots__" not in cls.__dict__:
            raise ValueError(
                f"{cls.__qualname__} must be declared with @dataclass(kw_only=True, slots=True)"
            )
        hints = _type_hints(cls)
        specs = []
        for field in dataclasses.fields(cls):
            where = f"{cls.__qualname__}.{field.name}"
            if field.name in ENVELOPE_KEYS:
                raise ValueError(f"{where}: the name is reserved for the envelope")
            if not field.kw_only:
                raise ValueError(f"{where}: the dataclass must be declared with kw_only=True")
            try:
                specs.append(_field_spec(field.name, hints[field.name]))
            except TypeError as exc:
                raise TypeError(f"{where}: {exc}") from None
        cls.TYPE = name
        cls.VERSION = version
        _REGISTRY[name] = MessageSchema(cls=cls, name=name, version=version, fields=tuple(specs))
        return cls

    return register


def schema_for(name: str) -> MessageSchema | None:
    """The schema registered under wire ``name``, or None."""
    return _REGISTRY.get(name)


def registered_messages() -> Mapping[str, type[Message]]:
    """Every registered message class by wire name (a snapshot)."""
    return {name: schema.cls for name, schema in _REGISTRY.items()}


_NONE_TYPE = type(None)
_SCALAR_TYPES: dict[object, frozenset[type]] = {
    bool: frozenset({bool}),
    int: frozenset({int}),
    # msgpack keeps 1 and 1.0 apart; an int is a fine float (as for mypy).
    float: frozenset({float, int}),
    str: frozenset({str}),
    bytes: frozenset({bytes}),
    _NONE_TYPE: frozenset({_NONE_TYPE}),
}
_ValueTypes = tuple[frozenset[type] | None, frozenset[type] | None, bool]


def record_specs(cls: type[Record]) -> tuple[FieldSpec, ...]:
    """The field specs of a record class (plain values only); ValueError/TypeError when the
    class cannot be a record."""
    if "__dataclass_fields__" not in cls.__dict__ or "__slots__" not in cls.__dict__:
        raise ValueError(f"{cls.__qualname__} must be declared with @dataclass(kw_only=True, "
                         "slots=True, frozen=True)")  # fmt: skip
    hints = _type_hints(cls)
    specs = []
    for field in dataclasses.fields(cls):
        spec = _field_spec(field.name, hints[field.name])
        if spec.kind is not FieldKind.VALUE:
            raise TypeError(f"{cls.__qualname__}.{field.name}: a record holds plain values only")
        specs.append(spec)
    return tuple(specs)


def _type_hints(cls: type) -> dict[str, Any]:
    """The resolved field annotations of ``cls``, ``Tensor`` as :class:`TensorAnnotation`;
    TypeError naming the class when one does not resolve."""
    try:
        return typing.get_type_hints(cls, localns=_ANNOTATION_NAMES)
    except NameError as exc:
        raise TypeError(
            f"{cls.__qualname__}: {exc} (annotate tensor fields as Tensor, from torch)"
        ) from exc


def _is_tensor(annotation: object) -> bool:
    if annotation is TensorAnnotation:
        return True
    # Without torch imported, no annotation can be torch.Tensor: importing it here would
    # cost what TensorAnnotation saves.
    torch = sys.modules.get("torch")
    return torch is not None and annotation is torch.Tensor


def _field_spec(name: str, annotation: object) -> FieldSpec:
    if _is_tensor(annotation):
        return FieldSpec(name=name, kind=FieldKind.TENSOR)
    if isinstance(annotation, type) and issubclass(annotation, Record):
        return FieldSpec(
            name=name, kind=FieldKind.RECORD, record=annotation,
            record_fields=record_specs(annotation),
        )  # fmt: skip
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation) or (Any,)
        if isinstance(item, type) and issubclass(item, Record):
            return FieldSpec(
                name=name, kind=FieldKind.RECORD_LIST, record=item,
                record_fields=record_specs(item),
            )  # fmt: skip
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is dict and args[:1] == (str,) and _is_tensor(args[-1]):
        return FieldSpec(name=name, kind=FieldKind.TENSOR_DICT)
    value_types, item_types, nested = _value_types(annotation)
    return FieldSpec(
        name=name, kind=FieldKind.VALUE, types=value_types, item_types=item_types, nested=nested
    )


def _value_types(annotation: object) -> _ValueTypes:
    """(types, item_types, nested) of a plain-value annotation; TypeError if unsupported."""
    if annotation is Any:
        return None, None, True
    if annotation in _SCALAR_TYPES:
        return _SCALAR_TYPES[annotation], None, False
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    container = origin if origin is not None else annotation
    if container is list or container is dict:
        if container is dict and args and args[0] is not str:
            raise TypeError(f"dict keys must be str in {annotation!r}")
        item = args[-1] if args else Any
        if item in _SCALAR_TYPES:
            return frozenset({container}), _SCALAR_TYPES[item], False
        _value_types(item)  # rejects tensors and other types nested deeper
        return frozenset({container}), None, True
    if origin is types.UnionType or origin is typing.Union:
        arms = [_value_types(arm) for arm in args]
        if any(arm_types is None for arm_types, _, _ in arms):
            return None, None, True
        value_types = frozenset().union(*(arm_types or () for arm_types, _, _ in arms))
        containers = [arm for arm in arms if arm[0] and arm[0] & {list, dict}]
        item_types: frozenset[type] | None = None
        if containers and all(items is not None for _, items, _ in containers):
            item_types = frozenset().union(*(items or () for _, items, _ in containers))
        nested = any(arm_nested for _, _, arm_nested in arms)
        return value_types, item_types, nested
    raise TypeError(
        f"unsupported field type {annotation!r}: use None, bool, int, float, str, bytes, list, "
        "dict[str, ...], Any, Tensor, dict[str, Tensor], a Record or list[Record]"
    )
