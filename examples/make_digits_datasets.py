"""Write scikit-learn's digits in the formats users have, for the image-file examples.

    python examples/make_digits_datasets.py data/digits

writes, under the given directory (default ``data/digits``):

- ``images/<label>/<index>.png``: an image folder (``examples/imagefolder.yaml``);
- ``wds/{000000..000003}.tar`` + ``manifest.json``: that folder packed as WebDataset shards by
  ``conveyor dataset pack`` (``examples/webdataset.yaml``);
- ``parquet/train.parquet``: the layout of a Hugging Face image dataset's Parquet export, an
  ``image`` struct of PNG bytes and an int ``label`` (``examples/parquet.yaml``);
- ``npz/``: the same images as npz shards, in the same sample order (class by class), the
  reference the other three are compared with.

Every format holds the same 1,797 grayscale 8x8 images (0..16 scaled to 0..255) with the same
sample ids: the image folder's order (classes by name, files by name) is the digits sorted by
label, and the other three are written in that order.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image
from sklearn.datasets import load_digits

from conveyor.training.datasets.pack import pack_npz
from conveyor.training.datasets.pack_webdataset import pack_imagefolder


def png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def main(root: Path) -> None:
    digits = load_digits()
    x = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)  # [N,8,8]
    y = digits.target.astype(np.int64)  # [N]
    order = np.argsort(y, kind="stable")  # the image folder's sample order
    x, y = x[order], y[order]
    encoded = [png(image) for image in x]
    for index, (data, label) in enumerate(zip(encoded, y.tolist(), strict=True)):
        folder = root / "images" / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{index:04d}.png").write_bytes(data)
    pack_imagefolder(str(root / "images"), str(root / "wds"), shard_size=500, overwrite=True)
    (root / "parquet").mkdir(parents=True, exist_ok=True)
    image = pa.array([{"bytes": data, "path": f"{i:04d}.png"} for i, data in enumerate(encoded)])
    table = pa.table({"image": image, "label": pa.array(y, pa.int64())})
    pq.write_table(table, root / "parquet" / "train.parquet", row_group_size=256)
    pack_npz(x, y, str(root / "npz"), shard_size=500, overwrite=True)
    print(root)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "data/digits"))
