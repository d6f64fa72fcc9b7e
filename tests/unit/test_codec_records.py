"""Typed rows inside messages (Record fields): round trips and what decode refuses."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from codec_cases import raw_message

from conveyor.platform.codec import MalformedMessage, decode, encode
from conveyor.platform.messages import Message, Record, message


@dataclass(kw_only=True, slots=True, frozen=True)
class Row(Record):
    key: str
    weight: float
    tags: list[int]
    note: str | None = None

    def __post_init__(self) -> None:
        if self.weight < 0:
            raise ValueError(f"weight must be >= 0, got {self.weight}")


@message("tests.records.Table", version=1)
@dataclass(kw_only=True, slots=True)
class Table(Message):
    rows: list[Row]
    best: Row


def table() -> Table:
    return Table(
        rows=[Row(key="a", weight=1, tags=[1, 2]), Row(key="b", weight=0.5, tags=[], note="x")],
        best=Row(key="a", weight=1.0, tags=[1]),
    )


def wire_row(**overrides: object) -> dict[str, object]:
    return {"key": "a", "weight": 1.0, "tags": [1], "note": None, **overrides}


def test_records_round_trip_to_their_class() -> None:
    decoded = decode(encode(table()))
    assert isinstance(decoded, Table) and decoded == table()
    assert all(type(row) is Row for row in decoded.rows) and type(decoded.best) is Row


def test_records_travel_as_plain_maps() -> None:
    raw = raw_message({"v": 1, "type": "tests.records.Table", "rows": [wire_row()],
                       "best": wire_row(key="z", weight=2)})  # fmt: skip
    decoded = decode(raw)
    assert isinstance(decoded, Table)
    assert decoded.rows == [Row(key="a", weight=1.0, tags=[1])] and decoded.best.key == "z"


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        (wire_row(weight="heavy"), "Table.rows[0].weight: expected float | int, got str"),
        (wire_row(tags=[1, "2"]), "Table.rows[0].tags: items must be int"),
        ({"key": "a", "weight": 1.0, "tags": []}, "fields missing ['note']"),
        (wire_row(extra=1), "unknown ['extra']"),
        (wire_row(weight=-1.0), "Table.rows[0]: weight must be >= 0"),
        (["a", 1.0], "Table.rows[0]: expected a dict, got list"),
    ],
)
def test_decode_refuses_a_bad_row_and_names_it(row: object, reason: str) -> None:
    raw = raw_message({"v": 1, "type": "tests.records.Table", "rows": [row], "best": wire_row()})
    with pytest.raises(MalformedMessage) as refused:
        decode(raw)
    assert reason in str(refused.value)


def test_decode_refuses_a_row_where_a_list_of_rows_belongs() -> None:
    raw = raw_message({"v": 1, "type": "tests.records.Table", "rows": wire_row(),
                       "best": wire_row()})  # fmt: skip
    with pytest.raises(MalformedMessage, match=r"Table\.rows: expected a list"):
        decode(raw)


def test_encode_refuses_a_row_of_another_class_or_a_dict() -> None:
    with pytest.raises(MalformedMessage, match=r"Table.rows\[1\]: expected a Row, got dict"):
        rows = [Row(key="a", weight=1, tags=[]), wire_row()]
        encode(Table(rows=rows, best=table().best))  # type: ignore[arg-type]
    with pytest.raises(MalformedMessage, match=r"Table\.best\.tags: expected list, got tuple"):
        encode(Table(rows=[], best=Row(key="a", weight=1, tags=(1,))))  # type: ignore[arg-type]
