"""``imagefolder://<dir or s3 prefix>``: one folder per class of JPEG/PNG files of any size.

torchvision's ImageFolder convention: the classes are the folders directly under the root,
sorted by name (class id = position); a class's images are the ``.jpg``/``.jpeg``/``.png``
files anywhere below its folder (case-insensitive), ordered by (folder, file name); sample ids
run over the classes in order. Files directly under the root, other files and hidden names
(``.``-prefixed segments) are ignored; a class folder without an image is not a class.

``<dir or s3 prefix>``: a local directory, ``file://<dir>`` or ``s3://bucket/prefix`` (through
the object store). Opening lists the keys once (no image is read); each read fetches the files
of the ids asked. An image that cannot be fetched is a :class:`BadSample` (decoding, and so a
corrupt file, is the preprocessors' concern).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
from numpy.typing import NDArray

from conveyor.platform.config import StorageSettings
from conveyor.training.datasets.base import (
    IMAGE_EXTENSIONS,
    BadSample,
    DatasetError,
    DatasetUnavailable,
    EncodedDataset,
    EncodedSample,
    split_uri,
)
from conveyor.training.datasets.location import list_keys, open_location, read_object


def class_files(keys: list[str]) -> dict[str, list[str]]:
    """Class folder -> its image keys in sample order (see the module docstring)."""
    classes: defaultdict[str, list[str]] = defaultdict(list)
    for key in keys:
        folder, slash, _ = key.partition("/")
        if not slash or any(part.startswith(".") for part in key.split("/")):
            continue
        if key.lower().endswith(IMAGE_EXTENSIONS):
            classes[folder].append(key)
    return {name: sorted(classes[name], key=_folder_then_name) for name in sorted(classes)}


def _folder_then_name(key: str) -> tuple[str, str]:
    folder, _, name = key.rpartition("/")
    return folder, name


class ImageFolderDataset(EncodedDataset):
    """See the module docstring; ``classes`` names the class ids in order."""

    def __init__(self, uri: str, *, storage: StorageSettings | None = None) -> None:
        _, rest = split_uri(uri)
        location, _, query = rest.partition("?")
        if query:
            raise DatasetError(f"{uri}: imagefolder takes no parameters, got {query!r}")
        self._store, self._where = open_location(uri, location, storage)
        classes = class_files(list_keys(self._store, self._where))
        if not classes:
            raise DatasetError(
                f"{uri}: no class folder with {'/'.join(IMAGE_EXTENSIONS)} files under "
                f"{self._where}"
            )
        self.classes = list(classes)
        self._keys = [key for files in classes.values() for key in files]
        counts = [len(files) for files in classes.values()]
        self._labels = np.repeat(np.arange(len(counts), dtype=np.int64), counts)  # [N]
        super().__init__(uri=uri, num_samples=len(self._keys), num_classes=len(self.classes))

    def _read_encoded(self, ids: NDArray[np.int64]) -> tuple[list[EncodedSample], list[BadSample]]:
        good: list[EncodedSample] = []
        bad: list[BadSample] = []
        for sample_id in ids.tolist():
            key = self._keys[sample_id]
            source = f"{self._where}/{key}"
            try:
                data = read_object(self._store, self._where, key)
            except DatasetUnavailable:
                raise
            except DatasetError as exc:
                bad.append(BadSample(sample_id=sample_id, source=source, reason=str(exc)))
                continue
            label = int(self._labels[sample_id])
            good.append(EncodedSample(sample_id=sample_id, label=label, data=data, source=source))
        return good, bad
