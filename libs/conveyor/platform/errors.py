"""The base of every exception Conveyor raises on purpose.

Each library module derives its own base from :class:`ConveyorError`; the retry
policy travels on the class (``retriable``) so callers decide by type, not by
parsing messages.
"""

from __future__ import annotations

from typing import ClassVar


class ConveyorError(Exception):
    """Base class for Conveyor's own errors."""

    retriable: ClassVar[bool] = False
