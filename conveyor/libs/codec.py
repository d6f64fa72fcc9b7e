"""Binary encoding of :mod:`conveyor.libs.messages`: a msgpack header plus raw tensor bytes.

Layout of one encoded message (all offsets in bytes)::

    | msgpack map header | zero pad | tensor bytes | pad | tensor bytes | ...
    0                    header_end  payload_start = header_end rounded up to 64

The header is ``{"v": VERSION, "type": TYPE, <field>: <value>, ...}`` with the fields in
schema order. A tensor field's value (or each value of a ``dict[str, Tensor]`` field) is
``{"dtype": str, "shape": [int, ...], "offset": int, "nbytes": int}``; ``offset`` counts from
``payload_start``. Tensor bytes are C-contiguous and little-endian, laid out in header order,
each starting at a multiple of 64 bytes (so every decoded tensor is aligned as its dtype needs).
A message with no tensor bytes ends at ``header_end`` (no pad).

There is no length prefix: the decoder parses the header with ``msgpack.Unpacker`` and takes
``header_end`` from ``Unpacker.tell()``. msgpack copies every ``bin`` it decodes; keeping tensor
bytes outside the header lets :func:`decode` return tensors that are views of the received
buffer (``torch.frombuffer``), so a batch is copied once on encode and never on decode.

Decoding is strict and never runs code from the input: size limits first, no msgpack extension
types, no pickle, known message types and versions only, every field present with its declared
type, no unknown fields, tensor descriptors consistent with the bytes. Every failure is a
:class:`CodecError` whose text says why (it goes into the dead-letter record).
"""

from __future__ import annotations

import functools
import math
import re
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Any, NoReturn

import msgpack
import torch

from conveyor.libs.errors import ConveyorError
from conveyor.libs.messages import FieldKind, FieldSpec, Message, MessageSchema, schema_for

_MiB = 1024 * 1024
ALIGN_BYTES = 64
"""Alignment of the payload start and of every tensor's bytes."""
_PAD = bytes(ALIGN_BYTES)
# The first read of the header; almost every header fits, larger ones are read in growing steps.
_FIRST_HEADER_READ_BYTES = 8 * 1024
_MAX_NESTING = 32
_MISSING = object()
_thread_local = threading.local()

DTYPES: dict[str, torch.dtype] = {
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "bool": torch.bool,
}
"""Wire name -> dtype of every tensor dtype the codec carries."""
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_PLAIN_LEAVES = (type(None), bool, int, float, str, bytes)

if sys.byteorder != "little":  # tensor bytes travel in host order; every supported host is LE
    raise ImportError("conveyor.libs.codec needs a little-endian host")


@functools.cache
def _silence_read_only_buffer_warning() -> None:
    """Ignore torch.frombuffer's warning about read-only buffers, raised from this module only.

    Decoded tensors are documented as read-only views of a received ``bytes``. Installed on
    first use rather than at import, so it also holds where warning filters are reset after
    imports (pytest does so after collection); torch raises the warning once per process.
    """
    warnings.filterwarnings(
        "ignore",
        message="The given buffer is not writable",
        category=UserWarning,
        module=re.escape(__name__),
    )


class CodecError(ConveyorError, ValueError):
    """A message could not be encoded or decoded; the text says why. Never retriable."""


class MessageTooLarge(CodecError):
    """The message, or its header, is larger than the limits allow."""


class MalformedMessage(CodecError):
    """The bytes are not a well-formed message, or a field does not match its schema."""


class UnknownMessageType(CodecError):
    """The message type is not registered."""


class UnsupportedVersion(CodecError):
    """The message type is known but not in this schema version."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CodecLimits:
    """Bounds enforced on encode and decode; raise ValueError if not positive."""

    max_message_bytes: int = 16 * _MiB
    """Largest encoded message, header and tensor bytes together."""
    max_header_bytes: int = 1 * _MiB
    """Largest msgpack header."""
    max_tensors: int = 256
    """Most tensors in one message."""
    max_tensor_dims: int = 8
    """Most dimensions of one tensor."""

    def __post_init__(self) -> None:
        for name in ("max_message_bytes", "max_header_bytes", "max_tensors", "max_tensor_dims"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


DEFAULT_LIMITS = CodecLimits()


# ----------------------------------------------------------------------------------- encode


def encode(message: Message, *, limits: CodecLimits = DEFAULT_LIMITS) -> bytes:
    """Encode ``message``; tensor bytes are copied once, into the returned ``bytes``.

    Tensors may be non-contiguous (made contiguous first) or on another device (copied to the
    CPU first). Raises UnknownMessageType for an unregistered class, MalformedMessage when a
    field does not match its schema, MessageTooLarge past ``limits``.
    """
    schema = _schema_of(message)
    header: dict[str, Any] = {"v": schema.version, "type": schema.name}
    payload = _PayloadWriter(limits)
    # Encode checks what a type checker cannot (plain content of Any-typed values) and the
    # cheap top-level types; item-by-item checks of typed lists/dicts are left to decode.
    for spec in schema.fields:
        value = getattr(message, spec.name)
        if spec.kind is FieldKind.VALUE:
            if spec.types is not None and type(value) not in spec.types:
                _check_value(schema.name, spec, value, items=False)  # raises
            if spec.nested:
                _check_plain(f"{schema.name}.{spec.name}", value, depth=0)
            header[spec.name] = value
        elif spec.kind is FieldKind.TENSOR:
            header[spec.name] = payload.add(f"{schema.name}.{spec.name}", value)
        else:
            where = f"{schema.name}.{spec.name}"
            _check_str_dict(where, value)
            header[spec.name] = {
                key: payload.add(f"{where}[{key!r}]", t) for key, t in value.items()
            }
    try:
        head = _pack_header(header)
    except (TypeError, ValueError, OverflowError) as exc:
        raise MalformedMessage(f"{schema.name}: cannot pack header: {exc}") from exc
    if len(head) > limits.max_header_bytes:
        raise MessageTooLarge(
            f"{schema.name}: header of {len(head)} bytes, limit {limits.max_header_bytes}"
        )
    if payload.size == 0:
        return head
    pad = -len(head) % ALIGN_BYTES
    total = len(head) + pad + payload.size
    if total > limits.max_message_bytes:
        raise MessageTooLarge(
            f"{schema.name}: {total} bytes, max_message_bytes={limits.max_message_bytes}"
        )
    return b"".join([head, _PAD[:pad], *payload.chunks])


def _schema_of(message: Message) -> MessageSchema:
    name = getattr(type(message), "TYPE", None)
    schema = schema_for(name) if isinstance(name, str) else None
    if schema is None or schema.cls is not type(message):
        raise UnknownMessageType(f"{type(message).__qualname__} is not a registered message")
    return schema


class _PayloadWriter:
    """Lays tensors out after the header; holds views of their bytes until the final join."""

    __slots__ = ("chunks", "count", "limits", "size")

    def __init__(self, limits: CodecLimits) -> None:
        self.limits = limits
        self.chunks: list[memoryview] = []  # tensor bytes and the pads between them, in order
        self.size = 0  # payload bytes so far
        self.count = 0

    def add(self, where: str, tensor: object) -> dict[str, Any]:
        """Append ``tensor``; return its header descriptor."""
        if not isinstance(tensor, torch.Tensor):
            raise MalformedMessage(f"{where}: expected a tensor, got {type(tensor).__name__}")
        dtype_name = _DTYPE_NAMES.get(tensor.dtype)
        if dtype_name is None:
            raise MalformedMessage(f"{where}: unsupported dtype {tensor.dtype}")
        if tensor.layout is not torch.strided or tensor.is_meta:
            raise MalformedMessage(f"{where}: only dense tensors with data can be sent")
        if tensor.dim() > self.limits.max_tensor_dims:
            raise MalformedMessage(
                f"{where}: {tensor.dim()} dims, max_tensor_dims={self.limits.max_tensor_dims}"
            )
        self.count += 1
        if self.count > self.limits.max_tensors:
            raise MalformedMessage(f"{where}: more than max_tensors={self.limits.max_tensors}")
        nbytes = tensor.nbytes  # numel * itemsize, whatever the strides
        offset = self.size
        if nbytes:
            offset += -offset % ALIGN_BYTES
            # Checked before any copy, so an oversize tensor costs nothing.
            if offset + nbytes > self.limits.max_message_bytes:
                raise MessageTooLarge(
                    f"{where}: tensor ends at {offset + nbytes} bytes, "
                    f"max_message_bytes={self.limits.max_message_bytes}"
                )
            if offset > self.size:
                self.chunks.append(memoryview(_PAD)[: offset - self.size])
            self.chunks.append(_host_bytes(tensor))
            self.size = offset + nbytes
        shape = list(tensor.shape)
        return {"dtype": dtype_name, "shape": shape, "offset": offset, "nbytes": nbytes}


def _host_bytes(tensor: torch.Tensor) -> memoryview:
    """A view of the tensor's bytes in host memory, C-contiguous; copies only when it must."""
    # Each call below costs microseconds even when it is a no-op, hence the guards.
    if tensor.requires_grad:
        tensor = tensor.detach()
    if not tensor.is_cpu:
        tensor = tensor.cpu()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    if tensor.dtype is torch.bfloat16:  # numpy has no bfloat16; same bytes as int16
        tensor = tensor.view(torch.int16)
    return tensor.numpy().data


def _pack_header(header: dict[str, Any]) -> bytes:
    # A Packer per thread: packb() allocates a fresh 256 KiB buffer on every call.
    packer = getattr(_thread_local, "packer", None)
    if packer is None:
        packer = _thread_local.packer = msgpack.Packer(buf_size=16 * 1024)
    head: bytes = packer.pack(header)
    return head


# ----------------------------------------------------------------------------------- decode


def decode(
    data: bytes | bytearray | memoryview, *, limits: CodecLimits = DEFAULT_LIMITS
) -> Message:
    """Decode one message; its tensors are views of ``data`` (no copy).

    The tensors keep ``data`` alive. Do not write into them when ``data`` is ``bytes``
    (immutable); ``clone()`` first. With a ``bytearray``, later writes to it show in them.
    Raises MessageTooLarge (checked before parsing), UnknownMessageType, UnsupportedVersion,
    or MalformedMessage for anything else wrong with the bytes; never another exception type.
    """
    try:
        view = memoryview(data).cast("B")
    except (TypeError, ValueError) as exc:
        raise MalformedMessage(f"not a contiguous byte buffer: {exc}") from exc
    if view.nbytes > limits.max_message_bytes:
        raise MessageTooLarge(
            f"message is {view.nbytes} bytes, max_message_bytes={limits.max_message_bytes}"
        )
    try:
        header, header_end = _read_header(view, limits)
        return _build(header, header_end, view, limits)
    except CodecError:
        raise
    except (msgpack.UnpackException, ValueError, TypeError, OverflowError, RuntimeError) as exc:
        raise MalformedMessage(f"undecodable message: {type(exc).__name__}: {exc}") from exc


def _reject_ext(code: int, data: bytes) -> NoReturn:
    raise MalformedMessage(f"msgpack extension type {code} is not allowed")


def _read_header(view: memoryview, limits: CodecLimits) -> tuple[object, int]:
    """Parse the msgpack header; return it and the offset where it ends."""
    cap = limits.max_header_bytes
    unpacker = msgpack.Unpacker(
        max_buffer_size=cap,
        max_str_len=cap,
        max_bin_len=cap,
        max_array_len=cap,
        max_map_len=cap // 2,
        # max_ext_len=0 also stops the timestamp extension (-1), which bypasses ext_hook.
        max_ext_len=0,
        ext_hook=_reject_ext,
        strict_map_key=True,
        raw=False,
        read_size=min(cap, _FIRST_HEADER_READ_BYTES),  # default: a 1 MiB malloc per decode
    )
    # Feed only what the header needs: Unpacker copies what it is fed, and the tensor bytes
    # behind the header must not be copied.
    end = min(view.nbytes, cap)
    fed = 0
    step = _FIRST_HEADER_READ_BYTES
    while True:
        unpacker.feed(view[fed : min(fed + step, end)])
        fed = min(fed + step, end)
        try:
            header = unpacker.unpack()
        except msgpack.OutOfData:
            if fed < end:
                step *= 8
                continue
            if end < view.nbytes:
                raise MessageTooLarge(f"header exceeds max_header_bytes={cap}") from None
            raise MalformedMessage(f"truncated header ({view.nbytes} bytes)") from None
        return header, int(unpacker.tell())


def _build(header: object, header_end: int, view: memoryview, limits: CodecLimits) -> Message:
    if type(header) is not dict:
        raise MalformedMessage(f"header is a {type(header).__name__}, not a map")
    name = header.get("type")
    if type(name) is not str:
        raise MalformedMessage("header has no string 'type'")
    schema = schema_for(name)
    if schema is None:
        raise UnknownMessageType(f"unknown message type {name!r}")
    version = header.get("v")
    if type(version) is not int:
        raise MalformedMessage(f"{name}: header has no int 'v'")
    if version != schema.version:
        raise UnsupportedVersion(f"{name} version {version}, supported: {schema.version}")
    if len(header) != len(schema.fields) + 2:
        _fail_field_set(schema, header)

    tensors = _PayloadReader(view, header_end, limits)
    fields: dict[str, Any] = {}
    for spec in schema.fields:
        value = header.get(spec.name, _MISSING)
        if value is _MISSING:
            _fail_field_set(schema, header)
        if spec.kind is FieldKind.VALUE:
            # Inline fast path: most fields are scalars of the right type.
            value_type = type(value)
            if (
                (spec.types is not None and value_type not in spec.types)
                or value_type is list
                or value_type is dict
            ):
                _check_value(name, spec, value, items=True)
            fields[spec.name] = value
        elif spec.kind is FieldKind.TENSOR:
            fields[spec.name] = tensors.read(f"{name}.{spec.name}", value)
        else:
            where = f"{name}.{spec.name}"
            _check_str_dict(where, value)
            fields[spec.name] = {k: tensors.read(f"{where}[{k!r}]", d) for k, d in value.items()}
    tensors.check_end()
    try:
        return schema.cls(**fields)
    except (TypeError, ValueError) as exc:  # the schema's own __post_init__ checks
        raise MalformedMessage(f"{name}: {exc}") from exc


def _fail_field_set(schema: MessageSchema, header: dict[Any, Any]) -> NoReturn:
    expected = {spec.name for spec in schema.fields}
    present = {key for key in header if key not in ("v", "type")}
    problems = []
    if missing := sorted(expected - present):
        problems.append(f"missing fields {', '.join(missing)}")
    if unknown := sorted(map(repr, present - expected)):
        problems.append(f"unknown fields {', '.join(unknown)}")
    raise MalformedMessage(f"{schema.name}: {'; '.join(problems)}")


class _PayloadReader:
    """Turns tensor descriptors into views of the payload, checking them against the bytes."""

    __slots__ = ("count", "end", "header_end", "limits", "start", "view")

    def __init__(self, view: memoryview, header_end: int, limits: CodecLimits) -> None:
        self.view = view
        self.limits = limits
        self.header_end = header_end
        self.start = header_end + -header_end % ALIGN_BYTES  # payload_start
        self.end = 0  # end of the last tensor read, relative to payload_start
        self.count = 0

    def read(self, where: str, desc: object) -> torch.Tensor:
        if type(desc) is not dict or len(desc) != 4:
            raise MalformedMessage(
                f"{where}: a tensor must be a map of dtype, shape, offset, nbytes"
            )
        dtype_name, shape = desc.get("dtype"), desc.get("shape")
        offset, nbytes = desc.get("offset"), desc.get("nbytes")
        dtype = DTYPES.get(dtype_name) if type(dtype_name) is str else None
        if dtype is None:
            raise MalformedMessage(f"{where}: unsupported dtype {dtype_name!r}")
        if type(offset) is not int or type(nbytes) is not int:
            raise MalformedMessage(f"{where}: offset and nbytes must be ints")
        max_dim = self.limits.max_message_bytes
        if (
            type(shape) is not list
            or len(shape) > self.limits.max_tensor_dims
            or not all(type(d) is int and 0 <= d <= max_dim for d in shape)
        ):
            raise MalformedMessage(
                f"{where}: shape {shape!r} is not a list of at most "
                f"{self.limits.max_tensor_dims} sizes"
            )
        self.count += 1
        if self.count > self.limits.max_tensors:
            raise MalformedMessage(f"{where}: more than max_tensors={self.limits.max_tensors}")
        numel = math.prod(shape)
        if numel * dtype.itemsize != nbytes:
            raise MalformedMessage(f"{where}: {nbytes} bytes do not hold {dtype} {shape}")
        if nbytes == 0:  # no bytes, so the offset means nothing; frombuffer refuses 0 bytes
            return torch.empty(shape, dtype=dtype)
        if offset < self.end or offset % dtype.itemsize:
            raise MalformedMessage(f"{where}: offset {offset} overlaps or is misaligned")
        if self.start + offset + nbytes > self.view.nbytes:
            raise MalformedMessage(f"{where}: tensor bytes run past the end (truncated message?)")
        self.end = offset + nbytes
        if self.view.readonly:
            _silence_read_only_buffer_warning()
        flat = torch.frombuffer(self.view, dtype=dtype, count=numel, offset=self.start + offset)
        if dtype is torch.bool and bool((flat.view(torch.uint8) > 1).any()):
            raise MalformedMessage(f"{where}: bool tensor holds bytes other than 0 and 1")
        return flat.view(*shape) if shape else flat.view(())  # view(*list) parses fastest

    def check_end(self) -> None:
        """The message must end exactly where its last tensor does."""
        expected = self.start + self.end if self.end else self.header_end
        if self.view.nbytes != expected:
            raise MalformedMessage(
                f"message is {self.view.nbytes} bytes, its header and tensors make {expected}"
            )


# ------------------------------------------------------------------------------ field checks


def _check_value(schema_name: str, spec: FieldSpec, value: object, *, items: bool) -> None:
    """Check the exact type of a plain field; with ``items``, also dict keys and item types."""
    if spec.types is not None and type(value) not in spec.types:
        allowed = " | ".join(sorted(t.__name__ for t in spec.types))
        raise MalformedMessage(
            f"{schema_name}.{spec.name}: expected {allowed}, got {type(value).__name__}"
        )
    if not items:
        return
    if type(value) is dict:
        _check_str_dict(f"{schema_name}.{spec.name}", value)
        values: Any = value.values()
    elif type(value) is list:
        values = value
    else:
        return
    # set(map(type, ...)) runs in C: microseconds for hundreds of sample ids.
    if spec.item_types is not None and not set(map(type, values)) <= spec.item_types:
        allowed = " | ".join(sorted(t.__name__ for t in spec.item_types))
        raise MalformedMessage(f"{schema_name}.{spec.name}: items must be {allowed}")


def _check_str_dict(where: str, value: object) -> None:
    if type(value) is not dict:
        raise MalformedMessage(f"{where}: expected a dict, got {type(value).__name__}")
    if not set(map(type, value)) <= {str}:
        raise MalformedMessage(f"{where}: dict keys must be str")


def _check_plain(where: str, value: object, depth: int) -> None:
    """On encode: ``value`` must hold only plain values, with str keys (what decode accepts)."""
    if depth > _MAX_NESTING:
        raise MalformedMessage(f"{where}: nested deeper than {_MAX_NESTING}")
    if isinstance(value, _PLAIN_LEAVES):
        return
    if isinstance(value, list | tuple):
        for item in value:
            _check_plain(where, item, depth + 1)
    elif isinstance(value, dict):
        _check_str_dict(where, value)
        for item in value.values():
            _check_plain(where, item, depth + 1)
    elif isinstance(value, torch.Tensor):
        raise MalformedMessage(f"{where}: tensors go in Tensor or dict[str, Tensor] fields")
    else:
        raise MalformedMessage(f"{where}: cannot send a {type(value).__name__}")
