"""Sizes of the wire format: the layout constants and the bounds every message must stay in."""

from __future__ import annotations

from dataclasses import dataclass

_MiB = 1024 * 1024
ALIGN_BYTES = 64
"""Alignment of the payload start and of every tensor's bytes."""
PREFIX_BYTES = 4
"""Size of the header-length prefix (unsigned 32-bit little-endian)."""
_MAX_HEADER_LEN = 2**32 - 1
PADS = tuple(bytes(n) for n in range(ALIGN_BYTES))
"""``PADS[n]``: n zero bytes, to align what follows to :data:`ALIGN_BYTES`."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CodecLimits:
    """Bounds enforced on encode and decode; raise ValueError if not positive (or, for
    ``max_header_bytes``, not below 4 GiB: the header length travels as 32 bits)."""

    max_message_bytes: int = 16 * _MiB
    """Largest encoded message: length prefix, header and tensor bytes together."""
    max_header_bytes: int = 1 * _MiB
    """Largest msgpack header (not counting the 4-byte length prefix)."""
    max_tensors: int = 256
    """Most tensors in one message."""
    max_tensor_dims: int = 8
    """Most dimensions of one tensor."""

    def __post_init__(self) -> None:
        for name in ("max_message_bytes", "max_header_bytes", "max_tensors", "max_tensor_dims"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_header_bytes > _MAX_HEADER_LEN:
            raise ValueError(f"max_header_bytes must be < 4 GiB, got {self.max_header_bytes}")


DEFAULT_LIMITS = CodecLimits()
