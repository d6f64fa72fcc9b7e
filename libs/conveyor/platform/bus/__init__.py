"""The message bus: typed messages over Kafka topics (aiokafka), at-least-once, traced.

* :class:`TopicAdmin` creates and deletes topics. Nothing is auto-created: no client of the
  bus asks the broker to create a topic by asking for its metadata (:mod:`.metadata`), and
  neither producers nor consumers create any. :func:`create_topology` creates the global topics
  (the sharder, their one owner, calls it); :func:`wait_for_topics` waits for them.
* :class:`Producer` encodes, size-checks and sends; ``send`` returns the ack as a future.
* :class:`Consumer` decodes, bounds in-flight work, commits only acked prefixes, parks
  undecodable records on the dead-letter topic, and reports its lag.
* :class:`TopicTail` reads every partition of a topic without a group (whole logs, or the
  last record of each partition).
* :func:`process_span` traces the processing of a :class:`Received` record.

Client options derived from :class:`~conveyor.platform.config.KafkaSettings` live in
:mod:`conveyor.platform.bus.options`.
"""

from conveyor.platform.bus.admin import (
    TopicAdmin,
    create_topology,
    ensure_topics,
    wait_for_topics,
)
from conveyor.platform.bus.consumer import Consumer
from conveyor.platform.bus.errors import BusError, BusUnavailable, ConsumerStopped, RecordTooLarge
from conveyor.platform.bus.handlers import Handler
from conveyor.platform.bus.metadata import disable_topic_auto_creation
from conveyor.platform.bus.producer import Producer
from conveyor.platform.bus.received import Received
from conveyor.platform.bus.tail import Tailed, TopicTail, read_last
from conveyor.platform.bus.tracing import extract_context, inject_headers, process_span
from conveyor.platform.messages.topics import TopicSpec

disable_topic_auto_creation()  # before any client exists: see conveyor.platform.bus.metadata

__all__ = [
    "BusError",
    "BusUnavailable",
    "Consumer",
    "ConsumerStopped",
    "Handler",
    "Producer",
    "Received",
    "RecordTooLarge",
    "Tailed",
    "TopicAdmin",
    "TopicSpec",
    "TopicTail",
    "create_topology",
    "ensure_topics",
    "extract_context",
    "inject_headers",
    "process_span",
    "read_last",
    "wait_for_topics",
]
