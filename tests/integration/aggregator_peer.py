"""A scripted trainer-side peer of the gradient plane, for the aggregator's integration tests.

It plays several trainers (worker ids) in one event loop: real small_cnn gradients on digits
batches of the job's deterministic plan, sent as GradSlices + Contributions with Heartbeats,
evaluation at every epoch end as one EvalResult per eval batch. It records every gradient it
sent (as the aggregator decodes it) so a test can replay the job with one torch optimizer.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable
from typing import Any

import torch
from heartbeats import heartbeat
from torch.nn import functional as F

from conveyor.platform.bus import Producer, TopicTail
from conveyor.platform.config import KafkaSettings
from conveyor.platform.messages import (
    Contribution,
    EvalResult,
    GradSlice,
    JobEvent,
    ParamSlice,
    Rejection,
    StepClose,
    Topics,
    batch_id_for,
    sample_ids_tensor,
)
from conveyor.services.aggregator.job import JobContext
from conveyor.training.compression import TopKFeedback, decode_slice, encode_slice, encoding_for
from conveyor.training.datasets import Dataset
from conveyor.training.optim import build_optimizer
from conveyor.training.plan import parse_batch_id


class Peer:
    """Trainers ``workers`` of job ``ctx`` (see the module docstring)."""

    def __init__(
        self,
        kafka: KafkaSettings,
        ctx: JobContext,
        dataset: Dataset,
        workers: dict[str, float],
    ) -> None:
        """``workers``: worker id -> the samples_per_second its heartbeats report."""
        self.kafka = kafka
        self.ctx = ctx
        self.dataset = dataset
        self.workers = workers
        self.topics = Topics(kafka.topic_prefix)
        self.job_id = ctx.job_id
        self.model = ctx.build_model()
        self.eval_model = ctx.build_model()
        self.params: dict[int, dict[int, torch.Tensor]] = {}
        """version -> slice -> values (first ParamSlice of each wins)."""
        self.closes: dict[int, StepClose] = {}
        self.rejections: dict[str, Rejection] = {}
        self.events: list[JobEvent] = []
        self.sent: dict[str, torch.Tensor] = {}
        """contribution id -> the flat gradient as the aggregator decodes it."""
        self.loss_sums: dict[str, float] = {}
        """contribution id -> the loss sum it reported."""
        self.eval_sums: dict[int, list[float]] = {}
        """epoch -> [loss sum, correct, samples] of this peer's evaluation."""
        self.epoch_end: dict[int, int] = {}
        """epoch -> the version whose StepClose applied its last train batch."""
        self._applied: dict[int, int] = {}
        self.heartbeats_on = set(workers)
        spec = ctx.spec
        self.feedback = {
            w: TopKFeedback(spec.distribution.compression.ratio or 1.0) for w in workers
        }
        self._changed = asyncio.Event()
        self._seq = itertools.count()
        self._producer = Producer(kafka)
        self._tasks: list[asyncio.Task[None]] = []

    # -- plumbing --------------------------------------------------------------------------

    async def __aenter__(self) -> Peer:
        await self._producer.start()
        for topic, fold in (
            (self.topics.params(self.job_id), self._fold_params),
            (self.topics.control(self.job_id), self._fold_control),
            (self.topics.jobs, self._fold_jobs),
        ):
            self._tasks.append(asyncio.create_task(self._follow(topic, fold)))
        self._tasks.append(asyncio.create_task(self._heartbeats()))
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._producer.stop()

    async def _follow(self, topic: str, fold: Callable[[Any], None]) -> None:
        async with TopicTail(self.kafka, topic) as tail:
            while True:
                records = await tail.get_many(0.2)
                for record in records:
                    fold(record.message)
                if records:
                    previous, self._changed = self._changed, asyncio.Event()
                    previous.set()

    def _fold_params(self, message: Any) -> None:
        if isinstance(message, ParamSlice):
            self.params.setdefault(message.version, {}).setdefault(
                message.slice_index, message.values.clone()
            )

    def _fold_control(self, message: Any) -> None:
        if isinstance(message, StepClose) and message.version == len(self.closes) + 1:
            self.closes[message.version] = message
            for batch_id in message.batch_ids:
                epoch = int(batch_id.split(":")[1][1:])
                self._applied[epoch] = self._applied.get(epoch, 0) + 1
                if self._applied[epoch] == self.ctx.train_batches_per_epoch:
                    self.epoch_end[epoch] = message.version
        elif isinstance(message, Rejection):
            self.rejections.setdefault(message.contribution_id, message)

    def _fold_jobs(self, message: Any) -> None:
        if isinstance(message, JobEvent) and message.job_id == self.job_id:
            self.events.append(message)

    async def _heartbeats(self) -> None:
        control = self.topics.control(self.job_id)
        while True:
            for worker in sorted(self.heartbeats_on):
                beat = heartbeat(self.job_id, worker, samples_per_second=self.workers[worker],
                                 data_wait_ratio=0.01)  # fmt: skip
                await self._producer.publish(control, beat)
            await asyncio.sleep(0.3)

    async def wait_for(self, predicate: Callable[[], bool], timeout_s: float = 60.0) -> None:
        async with asyncio.timeout(timeout_s):
            while not predicate():
                await self._changed.wait()

    def event(self, name: str) -> list[JobEvent]:
        return [e for e in self.events if name == e.EVENT]

    # -- the job's data --------------------------------------------------------------------

    def train_batches(self, epoch: int) -> list[str]:
        return [
            batch_id_for(shard.shard_id, k)
            for shard in self.ctx.plan.epoch_shards(epoch)
            if shard.split == "train"
            for k in range(shard.num_batches)
        ]

    def eval_batches(self, epoch: int) -> list[str]:
        return [
            batch_id_for(shard.shard_id, k)
            for shard in self.ctx.plan.epoch_shards(epoch)
            if shard.split == "eval"
            for k in range(shard.num_batches)
        ]

    def sample_ids(self, batch_ids: list[str]) -> list[int]:
        """The samples of ``batch_ids`` (what a preprocessor would put in their batches)."""
        return [i for b in batch_ids for i in self.ctx.plan.batch_sample_ids(b)]

    def data(self, batch_ids: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.dataset.read(self.sample_ids(batch_ids))
        return torch.from_numpy(x).float() / 255.0, torch.from_numpy(y)

    def flat_params(self, version: int) -> torch.Tensor:
        slices = self.params[version]
        return torch.cat([slices[p] for p in range(self.ctx.num_slices)])

    def has_params(self, version: int) -> bool:
        return len(self.params.get(version, {})) == self.ctx.num_slices

    def newest_version(self) -> int:
        return max(v for v in self.params if self.has_params(v))

    # -- protocol steps --------------------------------------------------------------------

    async def contribute(self, worker: str, base: int, batch_ids: list[str]) -> str:
        """Compute on version ``base`` and send the GradSlices then the Contribution."""
        contribution_id = f"{worker}:{next(self._seq)}"
        num_samples, loss_sum, grad_bytes = 0, 0.0, 0
        if batch_ids:
            self.ctx.layout.load_flat(self.model, self.flat_params(base))
            self.model.zero_grad()
            x, y = self.data(batch_ids)
            loss = F.cross_entropy(self.model(x), y, reduction="sum")
            loss.backward()  # type: ignore[no-untyped-call]
            num_samples, loss_sum = int(y.numel()), float(loss.detach())
            flat = self.ctx.layout.flatten_grads(self.model)
            decoded, acks = [], []
            for p, (start, stop) in enumerate(self.ctx.bounds):
                encoded = self._encode(worker, p, flat[start:stop])
                decoded.append(decode_slice(encoded.encoding, encoded.values,
                                            encoded.indices, encoded.numel))  # fmt: skip
                grad_bytes += encoded.nbytes
                message = GradSlice(
                    job_id=self.job_id, contribution_id=contribution_id, worker_id=worker,
                    base_version=base, slice_index=p, numel=encoded.numel,
                    encoding=encoded.encoding, values=encoded.values, indices=encoded.indices,
                    sent_at=time.time(),
                )  # fmt: skip
                acks.append(await self._producer.send(
                    self.topics.grads(self.job_id), message, key=str(p), partition=p
                ))  # fmt: skip
            await asyncio.gather(*acks)
            self.sent[contribution_id] = torch.cat(decoded)
        self.loss_sums[contribution_id] = loss_sum
        await self._producer.publish(self.topics.control(self.job_id), Contribution(
            job_id=self.job_id, contribution_id=contribution_id, worker_id=worker,
            base_version=base, num_samples=num_samples, batch_ids=batch_ids,
            epoch=parse_batch_id(batch_ids[0]).epoch if batch_ids else 0,
            sample_ids=sample_ids_tensor(self.sample_ids(batch_ids)), loss_sum=loss_sum,
            grad_bytes=grad_bytes, sent_at=time.time(),
        ))  # fmt: skip
        return contribution_id

    def _encode(self, worker: str, p: int, grad: torch.Tensor) -> Any:
        compression = self.ctx.spec.distribution.compression
        if compression.kind == "topk":
            return self.feedback[worker].encode(p, grad)
        return encode_slice(grad, encoding_for(compression.kind))

    async def evaluate_epochs(self, epochs: int) -> None:
        """At each epoch's end, one EvalResult per eval batch on that version's params."""
        for epoch in range(epochs):
            await self.wait_for(lambda e=epoch: e in self.epoch_end, 120)  # type: ignore[misc]
            version = self.epoch_end[epoch]
            await self.wait_for(lambda v=version: self.has_params(v))  # type: ignore[misc]
            await self.evaluate(epoch, version)

    async def evaluate(self, epoch: int, version: int) -> None:
        """One EvalResult per eval batch of ``epoch`` on the params of ``version``."""
        self.ctx.layout.load_flat(self.eval_model, self.flat_params(version))
        workers = itertools.cycle(sorted(self.workers))
        sums = self.eval_sums.setdefault(epoch, [0.0, 0, 0])
        for batch_id in self.eval_batches(epoch):
            x, y = self.data([batch_id])
            with torch.no_grad():
                logits = self.eval_model(x)
            loss = float(F.cross_entropy(logits, y, reduction="sum"))
            correct = int((logits.argmax(1) == y).sum())
            sums[0] += loss
            sums[1] += correct
            sums[2] += int(y.numel())
            await self._producer.publish(self.topics.control(self.job_id), EvalResult(
                job_id=self.job_id, worker_id=next(workers), epoch=epoch, version=version,
                batch_ids=[batch_id], loss_sum=loss, correct=correct, num_samples=int(y.numel()),
            ))  # fmt: skip

    def applied_in_epoch(self, epoch: int) -> int:
        return self._applied.get(epoch, 0)

    # -- checking ----------------------------------------------------------------------------

    def replay(self) -> dict[int, torch.Tensor]:
        """version -> flat params of a single-process torch optimizer fed the same steps."""
        model = self.ctx.build_model()
        layout = self.ctx.layout
        optimizer = build_optimizer(self.ctx.spec.training.optimizer, model.parameters())
        flats = {0: layout.flatten_params(model)}
        for version in range(1, len(self.closes) + 1):
            close = self.closes[version]
            if close.num_samples > 0:
                total = torch.zeros(layout.numel)
                for entry in close.contributions:
                    if entry.num_samples > 0:
                        total += self.sent[entry.contribution_id]
                grad = total / close.num_samples
                for e, param in zip(layout.entries, model.parameters(), strict=True):
                    param.grad = grad[e.offset : e.offset + e.numel].view(e.shape).clone()
                for group in optimizer.param_groups:
                    group["lr"] = close.lr
                optimizer.step()
            flats[version] = layout.flatten_params(model)
        return flats
