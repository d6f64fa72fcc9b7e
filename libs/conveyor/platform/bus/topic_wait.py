"""Starting a reader once the broker lists its topics.

A job's processes start reading its topics as soon as they learn of the job, and the broker
may not list a topic yet: the sharder creates them while it plans the job, and a Kafka
cluster spreads a new topic's metadata to its brokers asynchronously. A group member that
joins without the topic in its metadata is assigned nothing and keeps nothing until its
client's next metadata refresh (``metadata.max.age.ms``, 5 minutes): a job's aggregators
joined that way once and left the job at step 0. A group-less reader finds no partitions to
assign. So a reader starts its consumer again, backing off, until the consumer's own
metadata (fetched at its start) has partitions for every topic, for at most
:attr:`KafkaSettings.topic_wait_s` seconds; then :class:`BusUnavailable` (retriable).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection

from aiokafka import AIOKafkaConsumer

from conveyor.platform.bus.errors import BusUnavailable

logger = logging.getLogger(__name__)

FIRST_RETRY_S = 0.05
"""The first back-off; it doubles up to :data:`MAX_RETRY_S`."""
MAX_RETRY_S = 1.0


async def start_when_listed(
    make: Callable[[], AIOKafkaConsumer], topics: Collection[str], *, timeout_s: float
) -> AIOKafkaConsumer:
    """A consumer from ``make``, started, whose metadata has partitions for every topic in
    ``topics``; see the module docstring. Raises what ``start()`` raises (aiokafka errors,
    for the caller to wrap) and :class:`BusUnavailable` once ``timeout_s`` has passed."""
    deadline = time.monotonic() + timeout_s
    retry_s = FIRST_RETRY_S
    logged = False
    while True:
        consumer = make()
        try:
            await consumer.start()
        except BaseException:
            await consumer.stop()
            raise
        missing = sorted(t for t in topics if not consumer.partitions_for_topic(t))
        if not missing:
            return consumer
        # aiokafka's stop right after start cancels a task that has not run yet, and the
        # stop then raises CancelledError; one turn of the loop lets it run.
        await asyncio.sleep(0)
        await consumer.stop()
        if time.monotonic() + retry_s > deadline:
            raise BusUnavailable(
                f"topic(s) {', '.join(missing)} not in the broker's metadata after "
                f"{timeout_s:g} s (were they created?)"
            )
        if not logged:
            logger.info("waiting for the broker to list %s", ", ".join(missing))
            logged = True
        await asyncio.sleep(retry_s)
        retry_s = min(2 * retry_s, MAX_RETRY_S)
