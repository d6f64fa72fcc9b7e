"""Write a byte-level token file from the Python standard library's own source, for the GPT
example (``examples/gpt.yaml``): every machine with Python has this corpus.

    python examples/make_stdlib_tokens.py [OUT] [--max-bytes N]

writes ``OUT`` (default ``data/stdlib/bytes.bin``): the bytes of the standard library's
top-level ``*.py`` files, in name order, each byte one little-endian uint16 token (nanoGPT's
``.bin`` layout, vocabulary 256), cut after ``--max-bytes`` bytes (default 262144). Train on
it with ``tokens://data/stdlib/bytes.bin?dtype=uint16&block_size=64&vocab_size=256``.
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

import numpy as np


def stdlib_bytes(max_bytes: int) -> bytes:
    """The first ``max_bytes`` bytes of the standard library's top-level sources, by name."""
    parts: list[bytes] = []
    total = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        data = path.read_bytes()
        parts.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(parts)[:max_bytes]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="data/stdlib/bytes.bin", type=Path)
    parser.add_argument("--max-bytes", type=int, default=1 << 18)
    args = parser.parse_args()
    corpus = stdlib_bytes(args.max_bytes)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.frombuffer(corpus, dtype=np.uint8).astype("<u2").tofile(args.out)
    print(f"wrote {len(corpus)} byte tokens to {args.out}")


if __name__ == "__main__":
    main()
