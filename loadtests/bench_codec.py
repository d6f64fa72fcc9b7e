"""Codec benchmark: encode+decode of uint8 Batch messages vs one plain copy of the same bytes.

For each batch shape, these cases run side by side, in rotating order within each repeat:
    copy        one new ``bytes`` holding x's and y's bytes, copied from the tensors' own
                memory: one allocation, one pass of memcpy, the least an encoder can do;
    codec       ``decode(encode(batch))``, the measured path;
    copy numpy  ``x.numpy().copy()`` (reference only: numpy's allocator, x alone);
    encode      ``encode(batch)`` alone, and decode ``decode(encoded)`` alone (breakdown).
Each sample times a loop calibrated per case to last about ``--sample-s``. ratio = median
over repeats of codec/copy, both taken in the same repeat, so slow phases of a shared machine
cancel out.
The last line printed is one JSON object, {"codec_vs_memcpy": <ratio at the typical training
batch 256x3x32x32>, "codec_vs_memcpy_by_size": {shape: ratio}}: the headline is the batch a
training job actually moves, not the most flattering size, and is measured even when
``--sizes`` leaves it out; at small shapes the fixed per-message cost dominates, shown in the
table as overhead (codec - copy, microseconds). The table's caption gives the load average
before and after: on a shared machine, compare runs only under similar load (a loaded machine
slows the copy more than the codec, which flatters the ratio).

    .venv/bin/python -m loadtests.bench_codec --repeats 30 --sizes 64x1x8x8,256x3x32x32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
from rich.console import Console
from rich.table import Table

from conveyor.platform.codec import CodecLimits, decode, encode
from conveyor.platform.messages import Batch

DEFAULT_SIZES = "64x1x8x8,256x3x32x32,64x3x224x224"


Shape = tuple[int, int, int, int]


TYPICAL_SHAPE: Shape = (256, 3, 32, 32)
"""A CIFAR-sized training micro-batch: the headline size."""


def parse_sizes(text: str) -> list[Shape]:
    """``"64x1x8x8,256x3x32x32"`` -> [(64, 1, 8, 8), (256, 3, 32, 32)]."""
    shapes: list[Shape] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            b, c, h, w = (int(dim) for dim in item.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"size {item!r} is not BxCxHxW") from None
        if min(b, c, h, w) < 1:
            raise argparse.ArgumentTypeError(f"size {item!r} has a dimension < 1")
        shapes.append((b, c, h, w))
    if not shapes:
        raise argparse.ArgumentTypeError("no sizes given")
    return shapes


def make_batch(shape: Shape, rng: torch.Generator) -> Batch:
    b = shape[0]
    return Batch(
        job_id="bench",
        batch_id=f"bench-{b}",
        shard_id="bench-shard",
        epoch=0,
        split="train",
        sample_ids=list(range(1_000_000, 1_000_000 + b)),
        x=torch.randint(0, 256, shape, dtype=torch.uint8, generator=rng),  # [B, C, H, W]
        y=torch.randint(0, 1000, (b,), dtype=torch.int64, generator=rng),  # [B]
        timestamps={"read": time.time(), "preprocessed": time.time()},
    )


def time_per_call(fn: Callable[[], object], iterations: int) -> float:
    """Seconds per call of ``fn``, over one timed loop of ``iterations`` calls."""
    start = time.perf_counter()
    for _ in range(iterations):
        fn()
    return (time.perf_counter() - start) / iterations


def bench_shape(shape: Shape, repeats: int, sample_s: float) -> dict[str, float]:
    batch = make_batch(shape, torch.Generator().manual_seed(0))
    # Room for any --sizes; limits are checked, not allocated, so they cost the same.
    payload_bytes = batch.x.nbytes + batch.y.nbytes
    limits = CodecLimits(max_message_bytes=max(16 * 2**20, payload_bytes + 2**20))
    encoded = encode(batch, limits=limits)
    decoded = decode(encoded, limits=limits)
    assert isinstance(decoded, Batch)
    assert torch.equal(decoded.x, batch.x) and torch.equal(decoded.y, batch.y)
    # The baseline copies exactly the tensor bytes the codec carries, from the same memory,
    # into one new bytes object (what encode must produce at the least).
    x_bytes, y_bytes = batch.x.numpy().data, batch.y.numpy().data
    x_array = batch.x.numpy()

    cases: dict[str, Callable[[], object]] = {
        "copy": lambda: b"".join((x_bytes, y_bytes)),
        "codec": lambda: decode(encode(batch, limits=limits), limits=limits),
        "copy_numpy": x_array.copy,
        "encode": lambda: encode(batch, limits=limits),
        "decode": lambda: decode(encoded, limits=limits),
    }
    # Each case gets its own loop length, so every sample lasts about sample_s.
    iterations = {
        name: max(1, int(sample_s / max(time_per_call(fn, 3), 1e-9))) for name, fn in cases.items()
    }
    samples: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for rep in range(repeats):
        # Rotate the order so no case always runs right after the same neighbour.
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            samples[name].append(time_per_call(cases[name], iterations[name]))
    result = {name: statistics.median(values) for name, values in samples.items()}
    ratios = [c / m for c, m in zip(samples["codec"], samples["copy"], strict=True)]
    result["ratio"] = statistics.median(ratios)
    result["payload_bytes"] = float(payload_bytes)
    result["message_bytes"] = float(len(encoded))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=40, help="timed samples per case")
    parser.add_argument(
        "--sizes",
        type=parse_sizes,
        default=parse_sizes(DEFAULT_SIZES),
        help=f"comma-separated BxCxHxW (default {DEFAULT_SIZES})",
    )
    parser.add_argument(
        "--sample-s", type=float, default=0.01, help="target seconds of one timed sample"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)  # memcpy and the codec are single-threaded; so is the comparison
    shapes: list[Shape] = list(dict.fromkeys(args.sizes))  # in order, without repeats
    if TYPICAL_SHAPE not in shapes:
        shapes.append(TYPICAL_SHAPE)  # the headline is always measured

    load_before = os.getloadavg()
    results = [(shape, bench_shape(shape, args.repeats, args.sample_s)) for shape in shapes]
    load_after = os.getloadavg()

    table = Table(
        title=f"codec vs memcpy, uint8 Batch messages, medians of {args.repeats} repeats",
        caption=(
            f"load average (1, 5, 15 min) on {os.cpu_count()} CPUs: before "
            + ", ".join(f"{load:.2f}" for load in load_before)
            + "; after "
            + ", ".join(f"{load:.2f}" for load in load_after)
        ),
    )
    columns = ["shape", "payload", "copy", "codec (enc+dec)", "ratio", "overhead"]
    for column in [*columns, "encode", "decode", "copy numpy"]:
        table.add_column(column, justify="right")
    for shape, r in results:
        table.add_row(
            "x".join(map(str, shape)),
            f"{r['payload_bytes'] / 2**20:.3f} MiB",
            f"{r['copy'] * 1e6:.1f} us",
            f"{r['codec'] * 1e6:.1f} us",
            f"{r['ratio']:.2f}x",
            f"{(r['codec'] - r['copy']) * 1e6:.1f} us",
            f"{r['encode'] * 1e6:.1f} us",
            f"{r['decode'] * 1e6:.1f} us",
            f"{r['copy_numpy'] * 1e6:.1f} us",
        )
    headline_shape, headline = next(item for item in results if item[0] == TYPICAL_SHAPE)
    console = Console(width=150)
    console.print(table)
    console.print(
        "ratio = median over repeats of codec/copy timed in the same repeat; "
        "overhead = codec - copy.\n"
        f"codec_vs_memcpy = ratio at {'x'.join(map(str, headline_shape))}; "
        f"median ratio over shapes: {statistics.median(r['ratio'] for _, r in results):.2f}x"
    )
    by_size = {"x".join(map(str, shape)): round(r["ratio"], 3) for shape, r in results}
    print(
        json.dumps(
            {"codec_vs_memcpy": round(headline["ratio"], 3), "codec_vs_memcpy_by_size": by_size}
        )
    )


if __name__ == "__main__":
    main()
