"""The DataLoader baseline of bench_pipeline.py, which runs in its own process: the same
dataset, split, per-epoch order and augmentation as Conveyor's preprocessors, uint8
micro-batches from a DataLoader with persistent workers, normalised in the loop, the same model
and optimizer; measured over the steps after the warm-up like the Conveyor side."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from loadtests._bench_figures import Progress, WaitPoint, wait_window_after, window_after
from loadtests._bench_procs import child_pids, cpu_seconds, proc_memory, runqueue_wait_seconds

# -- the DataLoader baseline (runs in its own process) -------------------------------------------

TRAIN, EVAL = 0, 1


class ReleaseOrder(torch.utils.data.Sampler[list[tuple[int, int, int]]]):
    """Micro-batches of one epoch in Conveyor's release order: the train ids permuted by
    ``default_rng([seed, epoch])``, then the eval ids. Each index is (epoch, split, sample id),
    so persistent workers learn the epoch (the augmentation key) from the index itself."""

    def __init__(self, train_ids: np.ndarray, eval_ids: np.ndarray, micro: int, seed: int):
        self.train_ids, self.eval_ids = train_ids, eval_ids
        self.micro, self.seed, self.epoch = micro, seed, 0

    def _chunks(self, ids: np.ndarray, split: int) -> Iterator[list[tuple[int, int, int]]]:
        for start in range(0, len(ids), self.micro):
            yield [(self.epoch, split, int(i)) for i in ids[start : start + self.micro]]

    def __iter__(self) -> Iterator[list[tuple[int, int, int]]]:
        from conveyor.training.plan import epoch_order

        yield from self._chunks(epoch_order(self.train_ids, self.seed, self.epoch), TRAIN)
        yield from self._chunks(self.eval_ids, EVAL)

    def __len__(self) -> int:
        return -(-len(self.train_ids) // self.micro) + -(-len(self.eval_ids) // self.micro)


@dataclass(slots=True)
class HostBatch:
    """One collated micro-batch as a DataLoader worker hands it over.

    ``x`` uint8 [B,C,H,W] and ``y`` int64 [B] are numpy arrays (pickled through the worker's
    pipe) or tensors (torch's shared-memory hand-over). The DataLoader's pin-memory thread
    calls :meth:`pin_memory`, which makes pinned tensors of either.
    """

    x: np.ndarray | torch.Tensor
    y: np.ndarray | torch.Tensor
    epoch: int
    split: int

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) as tensors; numpy arrays are wrapped without a copy."""
        x, y = self.x, self.y
        return (
            torch.from_numpy(x) if isinstance(x, np.ndarray) else x,
            torch.from_numpy(y) if isinstance(y, np.ndarray) else y,
        )

    def pin_memory(self) -> HostBatch:
        x, y = self.tensors()
        return HostBatch(x.pin_memory(), y.pin_memory(), self.epoch, self.split)


class AugmentedImages(torch.utils.data.Dataset[HostBatch]):
    """A conveyor dataset read a micro-batch at a time (``__getitems__``), decoded (image files,
    to ``channels``) and augmented like the preprocessor does, returned collated as a
    :class:`HostBatch`."""

    def __init__(
        self,
        dataset: Any,
        augmenter: Any,
        seed: int,
        *,
        numpy_transport: bool,
        channels: int,
        reduce: bool = True,
    ) -> None:
        self.dataset, self.augmenter, self.seed = dataset, augmenter, seed
        # Evaluation batches get the deterministic ops only, as the preprocessors give them.
        self.eval_augmenter = augmenter.for_eval()
        self.numpy_transport, self.channels, self.reduce = numpy_transport, channels, reduce

    def __len__(self) -> int:
        return int(self.dataset.num_samples)

    def __getitem__(self, index: tuple[int, int, int]) -> HostBatch:
        return self.__getitems__([index])

    def __getitems__(self, indices: list[tuple[int, int, int]]) -> HostBatch:
        epoch, split = indices[0][0], indices[0][1]
        ids = [index[2] for index in indices]
        augmenter = self.eval_augmenter if split == EVAL else self.augmenter
        from conveyor.training.datasets import EncodedDataset
        from conveyor.training.datasets.images import EncodedImage

        if isinstance(self.dataset, EncodedDataset):
            encoded, _bad = self.dataset.read_encoded(ids)  # the benchmark's files are sound
            images = [EncodedImage.parse(s.data, channels=self.channels) for s in encoded]
            y = np.array([sample.label for sample in encoded], dtype=np.int64)  # [B]
            x = augmenter.apply_encoded(
                images, ids, seed=self.seed, epoch=epoch, reduce=self.reduce
            ).x  # [B,C,H,W]
        else:
            x, y = self.dataset.read(ids)  # [B,C,H,W] uint8, [B] int64
            x = augmenter.apply(x, ids, seed=self.seed, epoch=epoch)
        x = np.ascontiguousarray(x)
        batch = HostBatch(x, y, epoch, split)
        if self.numpy_transport:
            return batch
        x_tensor, y_tensor = batch.tensors()
        return HostBatch(x_tensor, y_tensor, epoch, split)


def as_is(batch: Any) -> Any:
    """collate_fn: ``__getitems__`` already collated the batch."""
    return batch


def own_session(_: int) -> None:
    """worker_init_fn: put the worker in its own session, as every Conveyor service process is
    (``conveyor up`` starts them with ``start_new_session``). With autogroup scheduling
    (/proc/sys/kernel/sched_autogroup_enabled) the kernel shares CPU fairly between sessions,
    so on a machine loaded by other work a process in its own session gets its own share."""
    os.setsid()


def baseline_main(config: dict[str, Any]) -> dict[str, Any]:
    """Train the job in this process with a DataLoader; returns the measurements."""
    from torch.nn import functional as F

    from conveyor.services.preprocessor.work import augmenter_for
    from conveyor.services.trainer.compute.engine import resolve_device
    from conveyor.training.datasets import open_dataset, output_shape
    from conveyor.training.jobspec import JobSpec
    from conveyor.training.models import build_model
    from conveyor.training.optim import build_optimizer
    from conveyor.training.plan import split_ids

    # CPU from here on, like the Conveyor trainer's from the job's submission: the job's set-up
    # (model, optimizer: its first construction imports torch._dynamo) counts for both.
    cpu_at_start = cpu_seconds(os.getpid()) or 0.0
    runq_at_start = runqueue_wait_seconds(os.getpid()) or 0.0
    spec_dict = config["spec"]
    spec = JobSpec.from_dict(spec_dict)
    training, workers = spec.training, int(config["workers"])
    if spec.resources.threads is not None:
        torch.set_num_threads(spec.resources.threads)
    device = resolve_device(spec.resources.device)
    dataset = open_dataset(spec.dataset.uri)
    preprocess = spec.preprocess
    channels, height, width = output_shape(
        dataset, image_size=preprocess.image_size, channels=preprocess.channels
    )
    train_ids, eval_ids = split_ids(dataset.num_samples, spec.dataset.eval_fraction, training.seed)
    order = ReleaseOrder(train_ids, eval_ids, training.micro_batch_size, training.seed)
    loader = torch.utils.data.DataLoader(
        AugmentedImages(
            dataset,
            augmenter_for(spec_dict["preprocess"]),
            training.seed,
            numpy_transport=config["transport"] == "numpy",
            channels=channels,
            reduce=config["decode"] == "reduced",
        ),
        batch_sampler=order,
        num_workers=workers,
        collate_fn=as_is,
        worker_init_fn=own_session,
        pin_memory=device.type == "cuda",
        persistent_workers=workers > 0,
        prefetch_factor=int(config["prefetch_factor"]) if workers > 0 else None,
    )
    torch.manual_seed(training.seed)
    options = {
        k: v for k, v in spec.model.options.items() if k not in ("num_classes", "in_channels")
    }
    model = build_model(
        spec.model.name,
        in_channels=channels,
        num_classes=dataset.num_classes,
        image_size=(height, width),
        **options,
    ).to(device)
    optimizer = build_optimizer(training.optimizer, list(model.parameters()))
    norm = spec.preprocess.normalize
    mean = torch.tensor(norm.mean if norm else [0.0], device=device).view(1, -1, 1, 1)
    std = torch.tensor(norm.std if norm else [1.0], device=device).view(1, -1, 1, 1)
    train_batches = -(-len(train_ids) // training.micro_batch_size)
    per_step = spec.micro_batches_per_step

    started = time.perf_counter()
    progress = [Progress(at_s=started, step=0, samples=0)]
    waits = [WaitPoint(at_s=started, step=0, wait_s=0.0, busy_s=0.0)]
    step = samples = 0
    wait_s = 0.0
    eval_correct = eval_samples = 0
    memory: dict[str, Any] = {}
    cpu: dict[str, float | None] = {}
    runq: dict[str, float | None] = {}
    for epoch in range(training.epochs):
        order.epoch = epoch
        model.train()
        micro = step_samples = trained = 0
        eval_correct = eval_samples = 0
        batches = iter(loader)
        while True:
            waited = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                break
            x, y = batch.tensors()
            wait_s += time.perf_counter() - waited
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            if batch.split == EVAL:  # after every train batch of the epoch, as in Conveyor
                model.eval()
                with torch.no_grad():
                    logits = model((x.float() / 255.0 - mean) / std)
                eval_correct += int((logits.argmax(dim=1) == y).sum())
                eval_samples += int(y.shape[0])
                continue
            logits = model((x.float() / 255.0 - mean) / std)  # [B,num_classes]
            loss = F.cross_entropy(logits, y, reduction="sum")
            loss.backward()  # type: ignore[no-untyped-call]
            loss.item()  # one device sync per micro-batch, as the trainer does
            micro, trained, step_samples = micro + 1, trained + 1, step_samples + int(y.shape[0])
            if micro == per_step or trained == train_batches:
                for param in model.parameters():
                    if param.grad is not None:
                        param.grad.mul_(1.0 / step_samples)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step, samples = step + 1, samples + step_samples
                micro = step_samples = 0
                now = time.perf_counter()
                progress.append(Progress(at_s=now, step=step, samples=samples))
                waits.append(WaitPoint(at_s=now, step=step, wait_s=wait_s, busy_s=now - started))
        if epoch == training.epochs - 1:
            # The persistent workers are still alive here: read their memory and CPU now.
            for index, pid in enumerate(child_pids(os.getpid()), start=1):
                memory[f"worker-{index}"] = proc_memory(pid)
                cpu[f"worker-{index}"] = cpu_seconds(pid)
                runq[f"worker-{index}"] = runqueue_wait_seconds(pid)
    total_s = time.perf_counter() - started
    memory["trainer"] = proc_memory(os.getpid())
    cpu["trainer"] = (cpu_seconds(os.getpid()) or 0.0) - cpu_at_start
    runq["trainer"] = (runqueue_wait_seconds(os.getpid()) or 0.0) - runq_at_start
    window = window_after(progress, int(config["warmup_steps"]))
    wait_window = wait_window_after(waits, int(config["warmup_steps"]))
    return {
        "samples_per_second": window.samples_per_second if window else None,
        "window_s": window.seconds if window else None,
        "data_wait_ratio": wait_window.wait_per_wall if wait_window else None,
        "trainer_wait_ratio": wait_window.wait_per_busy if wait_window else None,
        "accounted_share": wait_window.busy_per_wall if wait_window else None,
        "job_samples_per_second": samples / total_s,
        "job_data_wait_ratio": wait_s / total_s,
        "steps": step,
        "samples": samples,
        "eval_accuracy": eval_correct / eval_samples if eval_samples else None,
        "peak_rss_bytes": {k: v.peak_rss_bytes for k, v in memory.items() if v is not None},
        "cpu_s": cpu,
        "runq_s": runq,
    }
