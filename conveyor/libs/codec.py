"""Binary encoding of :mod:`conveyor.libs.messages`: a msgpack header plus raw tensor bytes.

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
microseconds), so each schema is compiled once into a :class:`_Plan` of field tables, and the
common case (every field of its declared type) is checked with a few C-level comparisons; the
field-by-field checks that name the culprit run only when those fail.
"""

from __future__ import annotations

import math
import struct
import sys
import threading
import warnings
from dataclasses import dataclass
from operator import attrgetter, countOf, itemgetter
from typing import Any, NoReturn

import msgpack
import numpy as np
import torch

from conveyor.libs.errors import ConveyorError
from conveyor.libs.messages import FieldKind, FieldSpec, Message, MessageSchema, schema_for

_MiB = 1024 * 1024
ALIGN_BYTES = 64
"""Alignment of the payload start and of every tensor's bytes."""
PREFIX_BYTES = 4
"""Size of the header-length prefix (unsigned 32-bit little-endian)."""
_PREFIX = struct.Struct("<I")
_MAX_HEADER_LEN = 2**32 - 1
_PADS = tuple(bytes(n) for n in range(ALIGN_BYTES))
_MAX_NESTING = 32
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
# Wire name -> (torch dtype, numpy dtype or None where numpy has none, itemsize). Decode builds
# tensors through numpy: np.ndarray + torch.from_numpy costs half of frombuffer + view.
_DTYPE_INFO: dict[str, tuple[torch.dtype, np.dtype[Any] | None, int]] = {
    name: (
        dtype,
        None if dtype is torch.bfloat16 else np.dtype(str(dtype).removeprefix("torch.")),
        dtype.itemsize,
    )
    for name, dtype in DTYPES.items()
}
_PLAIN_LEAVES = (type(None), bool, int, float, str, bytes)

if sys.byteorder != "little":  # tensor bytes travel in host order; every supported host is LE
    raise ImportError("conveyor.libs.codec needs a little-endian host")


def _use_up_read_only_warnings() -> None:
    """Decoded tensors are read-only views of a received ``bytes`` by design, and torch warns
    about such tensors once per process, from frombuffer and from_numpy each. Use both
    warnings up here, ignored, so decode never raises them (whatever the warning filters are
    by then: pytest resets them per test, ``-W error`` turns them into errors). As after any
    first warning, torch then stays silent about read-only buffers for the whole process."""
    read_only = memoryview(bytes(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.frombuffer(read_only, dtype=torch.uint8)
        torch.from_numpy(np.frombuffer(read_only, dtype=np.uint8))


_use_up_read_only_warnings()


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


# ------------------------------------------------------------------------------ schema plans


def _tuple_getter(getter: Any, names: tuple[str, ...]) -> Any:
    """``getter(*names)`` that always returns a tuple (itemgetter/attrgetter of one name
    returns the bare value, of none does not exist)."""
    if len(names) > 1:
        return getter(*names)
    if names:
        one = getter(names[0])
        return lambda obj: (one(obj),)
    return lambda obj: ()


class _Plan:
    """One schema compiled into the tables encode and decode walk (built once per schema)."""

    __slots__ = (
        "cls",
        "container_fields",
        "decode_types",
        "dict_tensor_fields",
        "encode_types",
        "field_names",
        "get_attrs",
        "get_items",
        "header_keys",
        "name",
        "nested_fields",
        "schema",
        "tensor_fields",
        "type_specs",
        "version",
    )

    def __init__(self, schema: MessageSchema) -> None:
        self.schema = schema
        self.cls = schema.cls
        self.name = schema.name
        self.version = schema.version
        self.field_names = tuple(spec.name for spec in schema.fields)
        self.header_keys = frozenset({"v", "type", *self.field_names})
        self.get_attrs = _tuple_getter(attrgetter, self.field_names)
        self.get_items = _tuple_getter(itemgetter, self.field_names)
        # The common type of each field's value, in order: when every value has it, one
        # comparison checks them all; otherwise _check_types checks each against its spec.
        self.encode_types = tuple(_main_type(spec, decoding=False) for spec in schema.fields)
        self.decode_types = tuple(_main_type(spec, decoding=True) for spec in schema.fields)
        self.type_specs = tuple((spec, f"{schema.name}.{spec.name}") for spec in schema.fields)
        self.tensor_fields = tuple(
            (spec.name, f"{schema.name}.{spec.name}")
            for spec in schema.fields
            if spec.kind is FieldKind.TENSOR
        )
        self.dict_tensor_fields = tuple(
            (spec.name, f"{schema.name}.{spec.name}")
            for spec in schema.fields
            if spec.kind is FieldKind.TENSOR_DICT
        )
        self.nested_fields = tuple(
            (spec.name, f"{schema.name}.{spec.name}")
            for spec in schema.fields
            if spec.kind is FieldKind.VALUE and spec.nested
        )
        # Plain fields that may hold a list or dict: decode checks dict keys and item types.
        self.container_fields = tuple(
            (spec.name, f"{schema.name}.{spec.name}", spec.item_types)
            for spec in schema.fields
            if spec.kind is FieldKind.VALUE and (spec.types is None or spec.types & {list, dict})
        )


def _main_type(spec: FieldSpec, *, decoding: bool) -> type | None:
    """The type a field's value has in the common case; None where there is none (Any)."""
    if spec.kind is FieldKind.TENSOR:
        return dict if decoding else torch.Tensor  # decoding: the tensor's descriptor
    if spec.kind is FieldKind.TENSOR_DICT:
        return dict
    if spec.types is None:  # Any
        return None
    likely = spec.types - {type(None)}  # an optional field is usually set
    if float in likely:  # float fields also take ints
        return float
    return next(iter(likely)) if len(likely) == 1 else None


_PLANS_BY_NAME: dict[str, _Plan] = {}
_PLANS_BY_CLASS: dict[type, _Plan] = {}


def _plan_named(name: str) -> _Plan | None:
    """The plan of wire type ``name``, or None. Registrations are final, so plans never go
    stale."""
    plan = _PLANS_BY_NAME.get(name)
    if plan is None:
        schema = schema_for(name)
        if schema is None:
            return None
        plan = _PLANS_BY_NAME[name] = _Plan(schema)
    return plan


def _plan_of(message: Message) -> _Plan:
    cls = type(message)
    plan = _PLANS_BY_CLASS.get(cls)
    if plan is None:
        name = getattr(cls, "TYPE", None)
        found = _plan_named(name) if isinstance(name, str) else None
        if found is None or found.cls is not cls:
            raise UnknownMessageType(f"{cls.__qualname__} is not a registered message")
        plan = _PLANS_BY_CLASS[cls] = found
    return plan


# ------------------------------------------------------------------------------------ encode


def encode(message: Message, *, limits: CodecLimits = DEFAULT_LIMITS) -> bytes:
    """Encode ``message``; tensor bytes are copied once, into the returned ``bytes``.

    Tensors may be non-contiguous (made contiguous first) or on another device (copied to the
    CPU first). Raises UnknownMessageType for an unregistered class, MalformedMessage when a
    field does not match its schema, MessageTooLarge past ``limits``.
    """
    plan = _PLANS_BY_CLASS.get(type(message)) or _plan_of(message)
    values = plan.get_attrs(message)
    # Encode checks what a type checker cannot (plain content of Any-typed values) and the
    # cheap top-level types; item-by-item checks of typed lists/dicts are left to decode.
    if tuple(map(type, values)) != plan.encode_types:
        _check_types(plan, values, decoding=False)
    for name, where in plan.nested_fields:
        _check_plain(where, getattr(message, name), depth=0)
    header: dict[str, Any] = {"v": plan.version, "type": plan.name}
    header.update(zip(plan.field_names, values, strict=False))  # same length
    payload = _PayloadWriter(limits)
    for name, where in plan.tensor_fields:
        header[name] = payload.add(where, header[name])
    for name, where in plan.dict_tensor_fields:
        tensors = header[name]
        _check_str_dict(where, tensors)
        header[name] = {key: payload.add(f"{where}[{key!r}]", t) for key, t in tensors.items()}
    try:
        head = _pack_header(header)
    except (TypeError, ValueError, OverflowError) as exc:
        raise MalformedMessage(f"{plan.name}: cannot pack header: {exc}") from exc
    if len(head) > limits.max_header_bytes:
        raise MessageTooLarge(
            f"{plan.name}: header of {len(head)} bytes, limit {limits.max_header_bytes}"
        )
    prefix = _PREFIX.pack(len(head))
    if payload.size == 0:
        total = PREFIX_BYTES + len(head)
        if total > limits.max_message_bytes:
            raise MessageTooLarge(
                f"{plan.name}: {total} bytes, max_message_bytes={limits.max_message_bytes}"
            )
        return prefix + head
    pad = -(PREFIX_BYTES + len(head)) % ALIGN_BYTES
    total = PREFIX_BYTES + len(head) + pad + payload.size
    if total > limits.max_message_bytes:
        raise MessageTooLarge(
            f"{plan.name}: {total} bytes, max_message_bytes={limits.max_message_bytes}"
        )
    return b"".join([prefix, head, _PADS[pad], *payload.chunks])


class _PayloadWriter:
    """Lays tensors out after the header; holds views of their bytes until the final join."""

    __slots__ = ("chunks", "count", "limits", "size")

    def __init__(self, limits: CodecLimits) -> None:
        self.limits = limits
        self.chunks: list[Any] = []  # tensor bytes and the pads between them, in order
        self.size = 0  # payload bytes so far
        self.count = 0

    def add(self, where: str, tensor: object) -> dict[str, Any]:
        """Append ``tensor``; return its header descriptor."""
        # type() first: isinstance goes through torch's metaclass, 3x slower for a Tensor.
        if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.Tensor):
            raise MalformedMessage(f"{where}: expected a tensor, got {type(tensor).__name__}")
        limits = self.limits
        dtype = tensor.dtype
        dtype_name = _DTYPE_NAMES.get(dtype)
        if dtype_name is None:
            raise MalformedMessage(f"{where}: unsupported dtype {dtype}")
        # numpy attributes cost a fraction of torch's, so the sizes come from the array when
        # the tensor's own memory will do; otherwise from the tensor, before any copy.
        array = _array_view(tensor, dtype)
        if array is not None:
            shape, nbytes = list(array.shape), array.nbytes
        else:
            if tensor.layout is not torch.strided or tensor.is_meta or tensor.is_nested:
                raise MalformedMessage(f"{where}: only dense tensors with data can be sent")
            shape, nbytes = list(tensor.shape), tensor.nbytes  # numel * itemsize
        if len(shape) > limits.max_tensor_dims:
            raise MalformedMessage(
                f"{where}: {len(shape)} dims, max_tensor_dims={limits.max_tensor_dims}"
            )
        self.count += 1
        if self.count > limits.max_tensors:
            raise MalformedMessage(f"{where}: more than max_tensors={limits.max_tensors}")
        offset = self.size
        if nbytes:
            pad = -offset % ALIGN_BYTES
            offset += pad
            # Checked before any copy, so an oversize tensor costs nothing.
            if offset + nbytes > limits.max_message_bytes:
                raise MessageTooLarge(
                    f"{where}: tensor ends at {offset + nbytes} bytes, "
                    f"max_message_bytes={limits.max_message_bytes}"
                )
            if pad:
                self.chunks.append(_PADS[pad])
            self.chunks.append(array if array is not None else _host_copy(tensor, dtype))
            self.size = offset + nbytes
        return {"dtype": dtype_name, "shape": shape, "offset": offset, "nbytes": nbytes}


def _array_view(tensor: torch.Tensor, dtype: torch.dtype) -> np.ndarray[Any, Any] | None:
    """The tensor's own bytes as a C-contiguous array, or None if they need a copy or a
    check first (another device or layout, bfloat16, autograd, non-contiguous)."""
    if dtype is torch.bfloat16 or tensor.requires_grad or not tensor.is_cpu:
        return None
    try:
        array = tensor.numpy()
    except (TypeError, RuntimeError):  # sparse, nested, a conjugate or negative view, ...
        return None
    return array if array.flags.c_contiguous else None


def _host_copy(tensor: torch.Tensor, dtype: torch.dtype) -> np.ndarray[Any, Any]:
    """The bytes of a dense tensor that :func:`_array_view` refused, in host memory and
    C-contiguous; copies only what must be copied."""
    # Each call below costs microseconds even when it is a no-op, hence the guards.
    if tensor.requires_grad:
        tensor = tensor.detach()
    if not tensor.is_cpu:
        tensor = tensor.cpu()
    if tensor.is_neg() or tensor.is_conj():
        tensor = tensor.resolve_neg().resolve_conj()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    if dtype is torch.bfloat16:  # numpy has no bfloat16; same bytes as int16
        tensor = tensor.view(torch.int16)
    return tensor.numpy()


def _pack_header(header: dict[str, Any]) -> bytes:
    # A Packer per thread: packb() allocates a fresh 256 KiB buffer on every call.
    packer = getattr(_thread_local, "packer", None)
    if packer is None:
        packer = _thread_local.packer = msgpack.Packer(buf_size=16 * 1024)
    head: bytes = packer.pack(header)
    return head


# ------------------------------------------------------------------------------------ decode


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
        # bytes are already a flat "B" buffer; the cast is for other buffers (costs ~1 us).
        view = memoryview(data) if type(data) is bytes else memoryview(data).cast("B")
    except (TypeError, ValueError) as exc:
        raise MalformedMessage(f"not a contiguous byte buffer: {exc}") from exc
    size = view.nbytes
    if size > limits.max_message_bytes:
        raise MessageTooLarge(
            f"message is {size} bytes, max_message_bytes={limits.max_message_bytes}"
        )
    if size < PREFIX_BYTES:
        raise MalformedMessage(f"truncated header: {size} bytes, no room for the length prefix")
    header_end = PREFIX_BYTES + _PREFIX.unpack_from(view)[0]
    if header_end > size:
        raise MalformedMessage(
            f"truncated header: it ends at byte {header_end}, the message has {size}"
        )
    if header_end - PREFIX_BYTES > limits.max_header_bytes:
        raise MessageTooLarge(
            f"header of {header_end - PREFIX_BYTES} bytes exceeds "
            f"max_header_bytes={limits.max_header_bytes}"
        )
    try:
        # The max_*_len limits default to the slice's length, itself within max_header_bytes.
        # max_ext_len=0 also stops the timestamp extension (-1), which bypasses ext_hook.
        header = msgpack.unpackb(
            view[PREFIX_BYTES:header_end],
            max_ext_len=0,
            ext_hook=_reject_ext,
            strict_map_key=True,
            raw=False,
        )
        return _build(header, header_end, view, limits)
    except CodecError:
        raise
    except (msgpack.UnpackException, ValueError, TypeError, OverflowError, RuntimeError) as exc:
        raise MalformedMessage(f"undecodable message: {type(exc).__name__}: {exc}") from exc


def _reject_ext(code: int, data: bytes) -> NoReturn:
    raise MalformedMessage(f"msgpack extension type {code} is not allowed")


def _build(header: object, header_end: int, view: memoryview, limits: CodecLimits) -> Message:
    if type(header) is not dict:
        raise MalformedMessage(f"header is a {type(header).__name__}, not a map")
    name = header.get("type")
    if type(name) is not str:
        raise MalformedMessage("header has no string 'type'")
    plan = _PLANS_BY_NAME.get(name) or _plan_named(name)
    if plan is None:
        raise UnknownMessageType(f"unknown message type {name!r}")
    version = header.get("v")
    if type(version) is not int:
        raise MalformedMessage(f"{name}: header has no int 'v'")
    if version != plan.version:
        raise UnsupportedVersion(f"{name} version {version}, supported: {plan.version}")
    if header.keys() != plan.header_keys:
        _fail_field_set(plan.schema, header)

    values = plan.get_items(header)
    if tuple(map(type, values)) != plan.decode_types:
        _check_types(plan, values, decoding=True)
    for field, where, item_types in plan.container_fields:
        value = header[field]
        if type(value) is dict:
            _check_str_dict(where, value)
            if item_types is not None:
                _check_items(where, value.values(), item_types)
        elif item_types is not None and type(value) is list:
            _check_items(where, value, item_types)

    tensors = _PayloadReader(view, header_end, limits)
    for field, where in plan.tensor_fields:
        header[field] = tensors.read(where, header[field])
    for field, where in plan.dict_tensor_fields:
        descs = header[field]
        _check_str_dict(where, descs)
        header[field] = {k: tensors.read(f"{where}[{k!r}]", d) for k, d in descs.items()}
    tensors.check_end()
    del header["v"], header["type"]  # what is left are exactly the fields, checked above
    try:
        return plan.cls(**header)
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
        # Four entries, each looked up: exactly the four keys (cheaper than comparing sets).
        try:
            if type(desc) is not dict or len(desc) != 4:
                raise KeyError
            dtype_name, shape = desc["dtype"], desc["shape"]
            offset, nbytes = desc["offset"], desc["nbytes"]
        except KeyError:
            raise MalformedMessage(
                f"{where}: a tensor must be a map of dtype, shape, offset, nbytes"
            ) from None
        try:
            info = _DTYPE_INFO.get(dtype_name)  # only str keys there: other types miss
        except TypeError:  # unhashable
            info = None
        if info is None:
            raise MalformedMessage(f"{where}: unsupported dtype {dtype_name!r}")
        dtype, np_dtype, itemsize = info
        if type(offset) is not int or type(nbytes) is not int:
            raise MalformedMessage(f"{where}: offset and nbytes must be ints")
        limits = self.limits
        if (
            type(shape) is not list
            or len(shape) > limits.max_tensor_dims
            or countOf(map(type, shape), int) != len(shape)  # exact ints: no bools
            or (shape and min(shape) < 0)
        ):
            raise MalformedMessage(
                f"{where}: shape {shape!r} is not a list of at most {limits.max_tensor_dims} sizes"
            )
        self.count += 1
        if self.count > limits.max_tensors:
            raise MalformedMessage(f"{where}: more than max_tensors={limits.max_tensors}")
        numel = math.prod(shape)
        if numel * itemsize != nbytes:
            raise MalformedMessage(f"{where}: {nbytes} bytes do not hold {dtype} {shape}")
        if nbytes == 0:  # no bytes, so the offset means nothing; frombuffer refuses 0 bytes
            # With bytes, each size is at most nbytes (bounded below); without, bound them here.
            if shape and max(shape) > limits.max_message_bytes:
                raise MalformedMessage(f"{where}: shape {shape!r} has a size over the limits")
            return torch.empty(shape, dtype=dtype)
        if offset < self.end or offset % itemsize:
            raise MalformedMessage(f"{where}: offset {offset} overlaps or is misaligned")
        start = self.start + offset
        if start + nbytes > self.view.nbytes:
            raise MalformedMessage(f"{where}: tensor bytes run past the end (truncated message?)")
        self.end = offset + nbytes
        if np_dtype is None:  # bfloat16
            flat = torch.frombuffer(self.view, dtype=dtype, count=numel, offset=start)
            return flat.view(*shape) if shape else flat.view(())  # view(*list) parses fastest
        tensor = torch.from_numpy(np.ndarray(shape, np_dtype, self.view, start))
        if dtype is torch.bool and bool((tensor.view(torch.uint8) > 1).any()):
            raise MalformedMessage(f"{where}: bool tensor holds bytes other than 0 and 1")
        return tensor

    def check_end(self) -> None:
        """The message must end exactly where its last tensor does."""
        expected = self.start + self.end if self.end else self.header_end
        if self.view.nbytes != expected:
            raise MalformedMessage(
                f"message is {self.view.nbytes} bytes, its header and tensors make {expected}"
            )


# ------------------------------------------------------------------------------ field checks


def _check_types(plan: _Plan, values: tuple[Any, ...], *, decoding: bool) -> None:
    """The slow path, when some value is not of its field's common type: check each value
    against its spec, raising MalformedMessage that names the first misfit."""
    for (spec, where), value in zip(plan.type_specs, values, strict=True):
        if spec.kind is FieldKind.VALUE:
            if spec.types is not None and type(value) not in spec.types:
                allowed = " | ".join(sorted(t.__name__ for t in spec.types))
                raise MalformedMessage(f"{where}: expected {allowed}, got {type(value).__name__}")
        elif spec.kind is FieldKind.TENSOR_DICT:
            _check_str_dict(where, value)
        elif not decoding and not isinstance(value, torch.Tensor):
            raise MalformedMessage(f"{where}: expected a tensor, got {type(value).__name__}")
        # A decoded tensor field holds a descriptor, checked by _PayloadReader.read.


def _check_items(where: str, values: Any, item_types: frozenset[type]) -> None:
    # Runs in C: a few microseconds for hundreds of sample ids.
    if len(item_types) == 1:
        (item_type,) = item_types
        ok = countOf(map(type, values), item_type) == len(values)
    else:
        ok = item_types.issuperset(map(type, values))
    if not ok:
        allowed = " | ".join(sorted(t.__name__ for t in item_types))
        raise MalformedMessage(f"{where}: items must be {allowed}")


def _check_str_dict(where: str, value: object) -> None:
    if type(value) is not dict:
        raise MalformedMessage(f"{where}: expected a dict, got {type(value).__name__}")
    if countOf(map(type, value), str) != len(value):
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
