"""``parquet://<file or dir>?image=image&label=label``: rows of image bytes and a class id.

The layout of a Hugging Face image dataset's Parquet export: an ``image`` column that is a
struct with a binary ``bytes`` field (the Image feature; ``path`` and other fields ignored), or
a plain binary column, and an integer ``label`` column. ``image=`` and ``label=`` name other
columns. ``<file or dir>``: one ``.parquet`` file or every ``*.parquet`` below a directory or
S3 prefix (sorted by key); local, ``file://`` or ``s3://`` through the object store.

Sample ids run over the files in order, then over their rows. ``num_classes``: the number of
class names in the Hugging Face schema metadata (a ClassLabel feature) when present, else the
largest label + 1.

Opening reads every file's footer (schema and row groups) and its label column, in ranges; a
read fetches the image column of the row groups holding the ids asked, in ranges. A column of
the wrong type fails the open naming the file, column and type; a null image or label, or a
label out of range, is a :class:`BadSample`.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from numpy.typing import NDArray

from conveyor.platform.config import StorageSettings
from conveyor.platform.storage import ObjectStore
from conveyor.training.datasets.base import (
    BadSample,
    DatasetError,
    EncodedDataset,
    EncodedSample,
    parse_query,
    split_uri,
)
from conveyor.training.datasets.location import (
    RangeFile,
    list_keys,
    open_file_location,
    open_location,
    stat_object,
)

_READ_BYTES = 1 << 20
"""Range size of reads inside one column chunk."""
_PYARROW_ERRORS = (pa.ArrowException, OSError, ValueError)


@dataclass(frozen=True, slots=True)
class _File:
    key: str
    size_bytes: int
    metadata: pq.FileMetaData
    row_group_starts: NDArray[np.int64]  # [G] first row of each row group


def _is_binary(kind: pa.DataType) -> bool:
    return bool(pa.types.is_binary(kind) or pa.types.is_large_binary(kind))


class ParquetDataset(EncodedDataset):
    """See the module docstring."""

    def __init__(self, uri: str, *, storage: StorageSettings | None = None) -> None:
        _, rest = split_uri(uri)
        location, _, query = rest.partition("?")
        params = parse_query(uri, query, ("image", "label"))
        self.image_column = params.get("image", "image")
        self.label_column = params.get("label", "label")
        self._store, self._where, keys = self._locate(uri, location, storage)
        files: list[_File] = []
        labels: list[NDArray[np.int64]] = []
        class_names: int | None = None
        for key in keys:
            file, file_labels, names = self._open_file(key)
            files.append(file)
            labels.append(file_labels)
            class_names = names if class_names is None else class_names
        self._files = files
        self._labels = np.concatenate(labels)  # [N]; -1 where the label is null
        sizes = [f.metadata.num_rows for f in files]
        self._starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)  # [F]
        num_classes = class_names or int(self._labels.max()) + 1
        super().__init__(uri=uri, num_samples=int(sum(sizes)), num_classes=max(num_classes, 1))

    @staticmethod
    def _locate(
        uri: str, location: str, storage: StorageSettings | None
    ) -> tuple[ObjectStore, str, list[str]]:
        """A single file when ``location`` names one, else every .parquet below it."""
        if location.rstrip("/").endswith(".parquet"):
            store, key, where = open_file_location(uri, location, storage)
            return store, where, [key]
        store, where = open_location(uri, location, storage)
        keys = [k for k in list_keys(store, where) if k.endswith(".parquet")]
        keys = [k for k in keys if not any(p.startswith(".") for p in k.split("/"))]
        if not keys:
            raise DatasetError(f"{uri}: no .parquet file under {where}")
        return store, where, keys

    def _reader(self, key: str, size_bytes: int, metadata: Any = None) -> pq.ParquetFile:
        raw = RangeFile(self._store, self._where, key, size_bytes)
        return pq.ParquetFile(io.BufferedReader(raw, buffer_size=_READ_BYTES), metadata=metadata)

    def _open_file(self, key: str) -> tuple[_File, NDArray[np.int64], int | None]:
        name = f"{self._where}/{key}"
        size = stat_object(self._store, self._where, key)
        try:
            reader = self._reader(key, size)
            schema = reader.schema_arrow
        except DatasetError:
            raise
        except _PYARROW_ERRORS as exc:
            raise DatasetError(f"{name} is not a readable Parquet file: {exc}") from exc
        self._check_schema(schema, name)
        try:
            column = reader.read(columns=[self.label_column]).column(0)
        except DatasetError:
            raise
        except _PYARROW_ERRORS as exc:
            raise DatasetError(f"{name}: cannot read column {self.label_column!r}: {exc}") from exc
        labels = column.fill_null(-1).to_numpy().astype(np.int64)  # [rows]
        metadata = reader.metadata
        rows = [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]
        starts = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64)
        file = _File(key=key, size_bytes=size, metadata=metadata, row_group_starts=starts)
        return file, labels, _class_names(schema, self.label_column)

    def _check_schema(self, schema: pa.Schema, name: str) -> None:
        for column in (self.image_column, self.label_column):
            if schema.get_field_index(column) < 0:
                raise DatasetError(f"{name}: no column {column!r} (columns: {schema.names})")
        image = schema.field(self.image_column).type
        if pa.types.is_struct(image):
            index = image.get_field_index("bytes")
            if index < 0 or not _is_binary(image.field(index).type):
                raise DatasetError(
                    f"{name}: column {self.image_column!r} is {image}, expected binary or a "
                    f"struct with a binary 'bytes' field"
                )
        elif not _is_binary(image):
            raise DatasetError(
                f"{name}: column {self.image_column!r} is {image}, expected binary or a struct "
                f"with a binary 'bytes' field"
            )
        label = schema.field(self.label_column).type
        if not pa.types.is_integer(label):
            raise DatasetError(
                f"{name}: column {self.label_column!r} is {label}, expected integers"
            )

    def _read_encoded(self, ids: NDArray[np.int64]) -> tuple[list[EncodedSample], list[BadSample]]:
        file_of = np.searchsorted(self._starts, ids, side="right") - 1  # [N]
        rows = ids - self._starts[file_of]  # [N] row within its file
        found: dict[int, EncodedSample | BadSample] = {}
        for f in np.unique(file_of).tolist():
            file = self._files[f]
            mask = file_of == f
            group_of = np.searchsorted(file.row_group_starts, rows[mask], side="right") - 1
            reader = self._reader(file.key, file.size_bytes, file.metadata)
            for g in np.unique(group_of).tolist():
                picked = group_of == g
                sample_ids = ids[mask][picked].tolist()
                file_rows = rows[mask][picked]
                local = (file_rows - file.row_group_starts[g]).tolist()
                images = self._row_group_images(reader, file, g)
                for sample_id, file_row, row in zip(
                    sample_ids, file_rows.tolist(), local, strict=True
                ):
                    source = f"{self._where}/{file.key}:row {file_row}"
                    found[sample_id] = self._sample(sample_id, source, images[row].as_py())
        good = [s for s in (found[i] for i in ids.tolist()) if isinstance(s, EncodedSample)]
        bad = [s for s in found.values() if isinstance(s, BadSample)]
        return good, bad

    def _row_group_images(self, reader: pq.ParquetFile, file: _File, group: int) -> pa.Array:
        name = f"{self._where}/{file.key}"
        try:
            column = reader.read_row_group(group, columns=[self.image_column]).column(0)
        except DatasetError:
            raise
        except _PYARROW_ERRORS as exc:
            raise DatasetError(f"{name}: row group {group} cannot be read: {exc}") from exc
        images = column.combine_chunks()
        if pa.types.is_struct(images.type):
            images = images.field("bytes")
        return images

    def _sample(self, sample_id: int, source: str, data: bytes | None) -> EncodedSample | BadSample:
        label = int(self._labels[sample_id])
        if data is None:
            return BadSample(sample_id=sample_id, source=source, reason="image is null")
        if label < 0:
            return BadSample(sample_id=sample_id, source=source, reason="label is null or < 0")
        return EncodedSample(sample_id=sample_id, label=label, data=data, source=source)


def _class_names(schema: pa.Schema, label_column: str) -> int | None:
    """How many class names the Hugging Face metadata gives the label column, if any."""
    raw = (schema.metadata or {}).get(b"huggingface")
    if raw is None:
        return None
    try:
        features = json.loads(raw)["info"]["features"]
        names = features[label_column]["names"]
    except (ValueError, KeyError, TypeError):
        return None
    return len(names) if isinstance(names, list) and names else None
