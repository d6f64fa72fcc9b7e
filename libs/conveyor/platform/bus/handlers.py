"""Handlers over a consumer: one call per record, bounded concurrency, an ack on return.

The loop behind :meth:`Consumer.run <conveyor.platform.bus.consumer.Consumer.run>`, built on the
consumer's public ``get`` and ``ack`` only: retriable broker errors are retried with backoff, a
handler's exception ends the loop (see ``Consumer.run`` for the contract).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from conveyor.platform.bus.errors import BusError, ConsumerStopped
from conveyor.platform.bus.received import Received

if TYPE_CHECKING:
    from conveyor.platform.bus.consumer import Consumer

logger = logging.getLogger(__name__)

Handler = Callable[[Received], Awaitable[None]]

_BACKOFF_INITIAL_S = 0.1
_BACKOFF_MAX_S = 5.0


async def run_handlers(consumer: Consumer, handler: Handler, concurrency: int) -> None:
    """Call ``handler`` for every record of ``consumer``, up to ``concurrency`` at a time, and
    ack each record after its handler returned, until the consumer is stopped. What
    :meth:`Consumer.run <conveyor.platform.bus.consumer.Consumer.run>` runs (its docstring
    states the contract); the consumer counts the running loops itself."""
    slots = asyncio.Semaphore(concurrency)
    backoff_s = _BACKOFF_INITIAL_S
    try:
        async with asyncio.TaskGroup() as handlers:
            while True:
                await slots.acquire()
                try:
                    received = await consumer.get()
                except ConsumerStopped:
                    return
                except BusError as exc:
                    slots.release()
                    if not exc.retriable:
                        raise
                    logger.warning(
                        "group %s: %s; retrying in %.1fs", consumer.group_id, exc, backoff_s
                    )
                    await asyncio.sleep(backoff_s)
                    backoff_s = min(backoff_s * 2, _BACKOFF_MAX_S)
                else:
                    backoff_s = _BACKOFF_INITIAL_S
                    handlers.create_task(_handle(consumer, handler, received, slots))
    except BaseExceptionGroup as group:
        # TaskGroup wraps the handler's exception; callers expect the exception itself.
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise


async def _handle(
    consumer: Consumer, handler: Handler, received: Received, slots: asyncio.Semaphore
) -> None:
    try:
        await handler(received)
    except Exception:
        logger.exception(
            "group %s: handler failed on %s[%d]@%d; not acked, it will be redelivered",
            consumer.group_id,
            received.topic,
            received.partition,
            received.offset,
        )
        raise
    finally:
        slots.release()
    consumer.ack(received)
