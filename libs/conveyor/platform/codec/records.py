"""Typed rows inside a message (:class:`~conveyor.platform.messages.Record`): to a msgpack map
on encode, back to their class on decode, with the checks a message's own fields get."""

from __future__ import annotations

from typing import Any

from conveyor.platform.codec.checks import _check_items, _check_plain, _check_str_dict
from conveyor.platform.codec.errors import MalformedMessage
from conveyor.platform.messages import FieldKind, FieldSpec, Record


def records_to_wire(where: str, spec: FieldSpec, value: object) -> Any:
    """The wire form of a RECORD (a map) or RECORD_LIST (a list of maps) field's value."""
    if spec.kind is FieldKind.RECORD:
        return _to_map(where, spec, value)
    if type(value) is not list:
        raise MalformedMessage(f"{where}: expected a list, got {type(value).__name__}")
    return [_to_map(f"{where}[{i}]", spec, item) for i, item in enumerate(value)]


def records_from_wire(where: str, spec: FieldSpec, value: object) -> Any:
    """The record (or list of records) of a decoded RECORD or RECORD_LIST field."""
    if spec.kind is FieldKind.RECORD:
        return _from_map(where, spec, value)
    if type(value) is not list:
        raise MalformedMessage(f"{where}: expected a list, got {type(value).__name__}")
    return [_from_map(f"{where}[{i}]", spec, item) for i, item in enumerate(value)]


def _to_map(where: str, spec: FieldSpec, record: object) -> dict[str, Any]:
    assert spec.record is not None
    if type(record) is not spec.record:
        raise MalformedMessage(
            f"{where}: expected a {spec.record.__name__}, got {type(record).__name__}"
        )
    row = {field.name: getattr(record, field.name) for field in spec.record_fields}
    _check_values(where, spec.record_fields, row)
    for field in spec.record_fields:
        if field.nested:
            _check_plain(f"{where}.{field.name}", row[field.name], depth=0)
    return row


def _from_map(where: str, spec: FieldSpec, row: object) -> Record:
    assert spec.record is not None
    _check_str_dict(where, row)
    assert isinstance(row, dict)
    expected = {field.name for field in spec.record_fields}
    if row.keys() != expected:
        missing, unknown = sorted(expected - row.keys()), sorted(row.keys() - expected)
        raise MalformedMessage(
            f"{where}: {spec.record.__name__} fields missing {missing}, unknown {unknown}"
        )
    _check_values(where, spec.record_fields, row)
    try:
        return spec.record(**row)
    except (TypeError, ValueError) as exc:  # the record's own __post_init__ checks
        raise MalformedMessage(f"{where}: {exc}") from exc


def _check_values(where: str, fields: tuple[FieldSpec, ...], row: dict[str, Any]) -> None:
    for field in fields:
        value, at = row[field.name], f"{where}.{field.name}"
        if field.types is not None and type(value) not in field.types:
            allowed = " | ".join(sorted(t.__name__ for t in field.types))
            raise MalformedMessage(f"{at}: expected {allowed}, got {type(value).__name__}")
        if type(value) is dict:
            _check_str_dict(at, value)
            if field.item_types is not None:
                _check_items(at, value.values(), field.item_types)
        elif type(value) is list and field.item_types is not None:
            _check_items(at, value, field.item_types)
