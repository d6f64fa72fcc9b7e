"""Encode and decode whole messages: the length prefix, the msgpack header and the envelope
checks around the tensor bytes (the layout is described in :mod:`conveyor.platform.codec`)."""

from __future__ import annotations

import struct
import threading
from typing import Any, NoReturn

import msgpack

from conveyor.platform.codec.checks import _check_items, _check_plain, _check_str_dict, _check_types
from conveyor.platform.codec.errors import (
    CodecError,
    MalformedMessage,
    MessageTooLarge,
    UnknownMessageType,
    UnsupportedVersion,
)
from conveyor.platform.codec.limits import (
    ALIGN_BYTES,
    DEFAULT_LIMITS,
    PADS,
    PREFIX_BYTES,
    CodecLimits,
)
from conveyor.platform.codec.plans import _PLANS_BY_CLASS, _PLANS_BY_NAME, _plan_named, _plan_of
from conveyor.platform.codec.records import records_from_wire, records_to_wire
from conveyor.platform.messages import Message, MessageSchema

_PREFIX = struct.Struct("<I")
_thread_local = threading.local()


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
    for name, where, spec in plan.record_fields:
        header[name] = records_to_wire(where, spec, header[name])
    chunks: list[Any] = []  # the tensors' bytes and the pads between them, in order
    payload_size = 0
    if plan.payload_writer is not None:
        payload = plan.payload_writer(limits)
        for name, where in plan.tensor_fields:
            header[name] = payload.add(where, header[name])
        for name, where in plan.dict_tensor_fields:
            tensors = header[name]
            _check_str_dict(where, tensors)
            header[name] = {key: payload.add(f"{where}[{key!r}]", t) for key, t in tensors.items()}
        chunks, payload_size = payload.chunks, payload.size
    try:
        head = _pack_header(header)
    except (TypeError, ValueError, OverflowError) as exc:
        raise MalformedMessage(f"{plan.name}: cannot pack header: {exc}") from exc
    if len(head) > limits.max_header_bytes:
        raise MessageTooLarge(
            f"{plan.name}: header of {len(head)} bytes, limit {limits.max_header_bytes}"
        )
    prefix = _PREFIX.pack(len(head))
    if payload_size == 0:
        total = PREFIX_BYTES + len(head)
        if total > limits.max_message_bytes:
            raise MessageTooLarge(
                f"{plan.name}: {total} bytes, max_message_bytes={limits.max_message_bytes}"
            )
        return prefix + head
    pad = -(PREFIX_BYTES + len(head)) % ALIGN_BYTES
    total = PREFIX_BYTES + len(head) + pad + payload_size
    if total > limits.max_message_bytes:
        raise MessageTooLarge(
            f"{plan.name}: {total} bytes, max_message_bytes={limits.max_message_bytes}"
        )
    return b"".join([prefix, head, PADS[pad], *chunks])


def _pack_header(header: dict[str, Any]) -> bytes:
    # A Packer per thread: packb() allocates a fresh 256 KiB buffer on every call.
    packer = getattr(_thread_local, "packer", None)
    if packer is None:
        packer = _thread_local.packer = msgpack.Packer(buf_size=16 * 1024)
    head: bytes = packer.pack(header)
    return head


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


_PEEK_BYTES = 256
"""Header bytes :func:`message_type` reads: ``v`` and ``type`` come first and are short."""


def message_type(data: bytes | bytearray | memoryview) -> str | None:
    """The wire type name of an encoded message, read from the first two entries of its header
    (:func:`encode` writes ``v`` then ``type`` first) without decoding the rest: a reader that
    wants some types only skips the others before their fields and tensors are built. None when
    the bytes do not start as :func:`encode` writes them: :func:`decode` then decides (and says
    why it refuses them)."""
    view = memoryview(data).cast("B")
    if view.nbytes < PREFIX_BYTES:
        return None
    header_end = min(PREFIX_BYTES + _PREFIX.unpack_from(view)[0], view.nbytes)
    unpacker = msgpack.Unpacker(max_ext_len=0, ext_hook=_reject_ext, strict_map_key=True, raw=False)
    unpacker.feed(view[PREFIX_BYTES : min(header_end, PREFIX_BYTES + _PEEK_BYTES)])
    try:
        if unpacker.read_map_header() < 2:
            return None
        entries = [unpacker.unpack() for _ in range(4)]  # "v", version, "type", name
    except (msgpack.UnpackException, ValueError, CodecError):
        return None
    if entries[0] != "v" or entries[2] != "type" or type(entries[3]) is not str:
        return None
    return entries[3]


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

    for field, where, spec in plan.record_fields:
        header[field] = records_from_wire(where, spec, header[field])

    reader = plan.payload_reader or plan.reader()
    if reader is not None:
        tensors = reader(view, header_end, limits)
        for field, where in plan.tensor_fields:
            header[field] = tensors.read(where, header[field])
        for field, where in plan.dict_tensor_fields:
            descs = header[field]
            _check_str_dict(where, descs)
            header[field] = {k: tensors.read(f"{where}[{k!r}]", d) for k, d in descs.items()}
        tensors.check_end()
    elif view.nbytes != header_end:  # no tensors: the message ends with its header
        raise MalformedMessage(
            f"message is {view.nbytes} bytes, its header and tensors make {header_end}"
        )
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
