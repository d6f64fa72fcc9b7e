"""The decode benchmark's parts: its JPEG folder, and its DataLoader baseline decoding and
augmenting exactly the pixels Conveyor's preprocessors send for the same samples."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from conveyor.platform.messages import ShardTask
from conveyor.services.preprocessor.work import augmenter_for, process_shard
from conveyor.training.datasets import open_dataset
from loadtests._pipeline_baseline import EVAL, TRAIN, AugmentedImages
from loadtests.bench_decode import CLASSES, SIDES_PX, decode_spec, write_jpeg_folder


def test_the_baseline_sees_the_preprocessors_pixels(tmp_path: Path) -> None:
    root = tmp_path / "jpegs"
    write_jpeg_folder(root, images=12)
    files = sorted(root.rglob("*.jpg"))
    assert len(files) == 12 and len({path.parent.name for path in files}) == CLASSES
    with Image.open(files[0]) as image:
        assert image.format == "JPEG" and all(SIDES_PX[0] <= s <= SIDES_PX[1] for s in image.size)
    spec = decode_spec(root, epochs=1, threads=1)
    dataset = open_dataset(spec["dataset"]["uri"])
    ids = [7, 0, 11, 3]
    augmenter = augmenter_for(spec["preprocess"])
    baseline = AugmentedImages(dataset, augmenter, 1, numpy_transport=True, channels=3)
    sent_of: dict[str, np.ndarray] = {}
    for split, index in (("train", TRAIN), ("eval", EVAL)):
        task = ShardTask(
            job_id="j", shard_id=f"j:e1:{split}:00000", epoch=1, index=0, split=split,
            dataset_uri=spec["dataset"]["uri"], sample_ids=ids, micro_batch_size=4, seed=1,
            preprocess=spec["preprocess"], released_at=0.0,
        )  # fmt: skip
        [sent] = process_shard(dataset, task, augmenter).batches
        x, y = baseline.__getitems__([(1, index, i) for i in ids]).tensors()
        assert list(x.shape) == [4, 3, 64, 64]
        assert np.array_equal(x.numpy(), sent.x) and y.tolist() == sent.y.tolist()
        sent_of[split] = np.asarray(sent.x)
    # Evaluation batches are not randomly cropped: the two splits' pixels differ.
    assert not np.array_equal(sent_of["train"], sent_of["eval"])
