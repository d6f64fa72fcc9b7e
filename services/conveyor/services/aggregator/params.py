"""The newest ParamSlice of each partition of a job's params topic."""

from __future__ import annotations

from conveyor.platform.bus import TopicTail
from conveyor.platform.config import KafkaSettings
from conveyor.platform.messages import ParamSlice

_POLL_S = 0.2


async def last_param_slices(kafka: KafkaSettings, topic: str) -> dict[int, ParamSlice]:
    """slice index -> the last ParamSlice of its partition as of the call (absent: empty).

    Reads from each partition's last record up to the end offsets captured at start, rather
    than asking for end offsets again (which the embedded broker can answer seconds late
    while the partition is being written). Raises BusError on broker failures.
    """
    last: dict[int, ParamSlice] = {}
    async with TopicTail(kafka, topic, start="last") as tail:
        while not tail.caught_up:
            for record in await tail.get_many(_POLL_S):
                if isinstance(record.message, ParamSlice):
                    last[record.partition] = record.message
    return last
