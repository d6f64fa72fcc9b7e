"""The codec's exceptions: one base class, so a reader catches every bad record in one place."""

from __future__ import annotations

from conveyor.platform.errors import ConveyorError


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
