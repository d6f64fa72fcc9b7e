"""Binary encoding of :mod:`conveyor.platform.messages`: a msgpack header plus raw tensor bytes.

Layout of one encoded message (all offsets in bytes)::

    | header_len | msgpack map header | zero pad | tensor bytes | pad | tensor bytes | ...
    0            4                    header_end  payload_start = header_end rounded up to 64

``header_len`` is an unsigned 32-bit little-endian integer, the size of the msgpack header
that follows it (``header_end = 4 + header_len``); the header must be exactly one msgpack
object of that size. The header is ``{"v": VERSION, "type": TYPE, <field>: <value>, ...}``
with the fields in schema order. A tensor field's value (or each value of a
``dict[str, Tensor]`` field) is ``{"dtype": str, "shape": [int, ...], "offset": int,
"nbytes": int}``; ``offset`` counts from ``payload_start``. Tensor bytes are C-contiguous and
little-endian, laid out in header order, each starting at a multiple of 64 bytes (so every
decoded tensor is aligned as its dtype needs). A message with no tensor bytes ends at
``header_end`` (no pad).

The length prefix lets the decoder parse the header with one ``msgpack.unpackb`` over a slice
of the input, which costs less than a streaming ``Unpacker`` per message and needs no guess at
where the header ends. msgpack copies every ``bin`` it decodes;
keeping tensor bytes outside the header lets :func:`decode` return tensors that are views of
the received buffer, so a batch is copied once on encode and never on decode.

Decoding is strict and never runs code from the input: size limits first, no msgpack extension
types, no pickle, known message types and versions only, every field present with its declared
type, no unknown fields, tensor descriptors consistent with the bytes. Every failure is a
:class:`CodecError` whose text says why (it goes into the dead-letter record).

Per-message cost matters as much as per-byte cost (a 256x3x32x32 uint8 batch copies in tens of
microseconds), so each schema is compiled once into a plan of field tables
(:mod:`~conveyor.platform.codec.plans`), and the common case (every field of its declared type) is
checked with a few C-level comparisons; the field-by-field checks that name the culprit
(:mod:`~conveyor.platform.codec.checks`) run only when those fail.

The package's modules: :mod:`~conveyor.platform.codec.framing` (encode, decode and the header),
:mod:`~conveyor.platform.codec.writer` (tensor bytes out, from torch tensors or numpy arrays;
imports numpy only), :mod:`~conveyor.platform.codec.tensors` (dtypes and tensor bytes in: the
one module that imports torch, loaded by the first decode of a schema with tensor fields),
:mod:`~conveyor.platform.codec.limits` (layout constants and :class:`CodecLimits`),
:mod:`~conveyor.platform.codec.errors`. Import from the package itself (``DTYPES`` from
:mod:`~conveyor.platform.codec.tensors`, which a torch-free process leaves unloaded).
"""

from conveyor.platform.codec.errors import (
    CodecError,
    MalformedMessage,
    MessageTooLarge,
    UnknownMessageType,
    UnsupportedVersion,
)
from conveyor.platform.codec.framing import decode, encode, message_type
from conveyor.platform.codec.limits import ALIGN_BYTES, DEFAULT_LIMITS, PREFIX_BYTES, CodecLimits

__all__ = [
    "ALIGN_BYTES",
    "DEFAULT_LIMITS",
    "PREFIX_BYTES",
    "CodecError",
    "CodecLimits",
    "MalformedMessage",
    "MessageTooLarge",
    "UnknownMessageType",
    "UnsupportedVersion",
    "decode",
    "encode",
    "message_type",
]
