"""Schemas compiled for the codec: each registered message class becomes a :class:`_Plan` of
field tables once, so encode and decode check the common case with a few C-level comparisons.
"""

from __future__ import annotations

import sys
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING, Any

from conveyor.platform.codec.errors import UnknownMessageType
from conveyor.platform.messages import FieldKind, FieldSpec, Message, MessageSchema, schema_for

if TYPE_CHECKING:
    from conveyor.platform.codec.tensors import _PayloadReader
    from conveyor.platform.codec.writer import _PayloadWriter


def _tuple_getter(getter: Any, names: tuple[str, ...]) -> Any:
    """``getter(*names)`` that always returns a tuple (itemgetter/attrgetter of one name
    returns the bare value, of none does not exist)."""
    if len(names) > 1:
        return getter(*names)
    if names:
        one = getter(names[0])
        return lambda obj: (one(obj),)
    return lambda obj: ()


class _Plan:
    """One schema compiled into the tables encode and decode walk (built once per schema)."""

    __slots__ = (
        "cls",
        "container_fields",
        "decode_types",
        "dict_tensor_fields",
        "encode_types",
        "field_names",
        "get_attrs",
        "get_items",
        "header_keys",
        "name",
        "nested_fields",
        "payload_reader",
        "payload_writer",
        "record_fields",
        "schema",
        "tensor_fields",
        "type_specs",
        "version",
    )

    def __init__(self, schema: MessageSchema) -> None:
        self.schema = schema
        self.cls = schema.cls
        self.name = schema.name
        self.version = schema.version
        self.field_names = tuple(spec.name for spec in schema.fields)
        self.header_keys = frozenset({"v", "type", *self.field_names})
        self.get_attrs = _tuple_getter(attrgetter, self.field_names)
        self.get_items = _tuple_getter(itemgetter, self.field_names)
        self.type_specs = tuple((spec, f"{schema.name}.{spec.name}") for spec in schema.fields)
        self.tensor_fields = tuple(
            (spec.name, f"{schema.name}.{spec.name}")
            for spec in schema.fields
            if spec.kind is FieldKind.TENSOR
        )
        self.dict_tensor_fields = tuple(
            (spec.name, f"{schema.name}.{spec.name}")
            for spec in schema.fields
            if spec.kind is FieldKind.TENSOR_DICT
        )
        self.nested_fields = tuple(
            (spec.name, f"{schema.name}.{spec.name}")
            for spec in schema.fields
            if spec.kind is FieldKind.VALUE and spec.nested
        )
        self.record_fields = tuple(
            (spec.name, f"{schema.name}.{spec.name}", spec)
            for spec in schema.fields
            if spec.kind in (FieldKind.RECORD, FieldKind.RECORD_LIST)
        )
        # Plain fields that may hold a list or dict: decode checks dict keys and item types.
        self.container_fields = tuple(
            (spec.name, f"{schema.name}.{spec.name}", spec.item_types)
            for spec in schema.fields
            if spec.kind is FieldKind.VALUE and (spec.types is None or spec.types & {list, dict})
        )
        # A schema with tensor fields loads the writer (numpy) now and the reader (torch) on
        # its first decode (:meth:`reader`): a process that only sends tensors as numpy arrays
        # (the preprocessors) never pays for torch's import, one that sends none not even for
        # numpy's.
        self.payload_writer: type[_PayloadWriter] | None = None
        self.payload_reader: type[_PayloadReader] | None = None
        tensor_type: type | None = None
        if self.tensor_fields or self.dict_tensor_fields:
            import numpy as np

            from conveyor.platform.codec import writer

            self.payload_writer = writer._PayloadWriter
            # What a tensor field holds in this process, for the one-comparison check: a
            # torch tensor once torch is loaded, else a numpy array (the other still passes,
            # through the field-by-field check).
            torch = sys.modules.get("torch")
            tensor_type = torch.Tensor if torch is not None else np.ndarray
        # The common type of each field's value, in order: when every value has it, one
        # comparison checks them all; otherwise _check_types checks each against its spec.
        self.encode_types = tuple(
            _main_type(spec, decoding=False, tensor_type=tensor_type) for spec in schema.fields
        )
        self.decode_types = tuple(
            _main_type(spec, decoding=True, tensor_type=tensor_type) for spec in schema.fields
        )

    def reader(self) -> type[_PayloadReader] | None:
        """The payload reader of a schema with tensor fields (None without), loading torch on
        the first call."""
        if self.payload_reader is None and self.payload_writer is not None:
            from conveyor.platform.codec import tensors

            self.payload_reader = tensors._PayloadReader
        return self.payload_reader


def _main_type(spec: FieldSpec, *, decoding: bool, tensor_type: type | None) -> type | None:
    """The type a field's value has in the common case; None where there is none (Any).
    ``tensor_type`` is ``torch.Tensor`` for a schema with tensor fields."""
    if spec.kind is FieldKind.TENSOR:
        return dict if decoding else tensor_type  # decoding: the tensor's descriptor
    if spec.kind is FieldKind.TENSOR_DICT:
        return dict
    if spec.kind is FieldKind.RECORD:
        return dict if decoding else spec.record
    if spec.kind is FieldKind.RECORD_LIST:
        return list
    if spec.types is None:  # Any
        return None
    likely = spec.types - {type(None)}  # an optional field is usually set
    if float in likely:  # float fields also take ints
        return float
    return next(iter(likely)) if len(likely) == 1 else None


_PLANS_BY_NAME: dict[str, _Plan] = {}
_PLANS_BY_CLASS: dict[type, _Plan] = {}


def _plan_named(name: str) -> _Plan | None:
    """The plan of wire type ``name``, or None. Registrations are final, so plans never go
    stale."""
    plan = _PLANS_BY_NAME.get(name)
    if plan is None:
        schema = schema_for(name)
        if schema is None:
            return None
        plan = _PLANS_BY_NAME[name] = _Plan(schema)
    return plan


def _plan_of(message: Message) -> _Plan:
    cls = type(message)
    plan = _PLANS_BY_CLASS.get(cls)
    if plan is None:
        name = getattr(cls, "TYPE", None)
        found = _plan_named(name) if isinstance(name, str) else None
        if found is None or found.cls is not cls:
            raise UnknownMessageType(f"{cls.__qualname__} is not a registered message")
        plan = _PLANS_BY_CLASS[cls] = found
    return plan
