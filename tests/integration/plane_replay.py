"""The oracle of the gradient-plane tests: a job's StepCloses replayed in plain single-process
PyTorch (property 1 of test_gradient_plane.py), with a diagnosis when a version differs."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from plane_capture import Run
from torch import nn
from torch.nn import functional as F
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from conveyor.training.jobspec import JobSpec
from conveyor.training.slicing import build_job_model


class Replica:
    """The job's model in one plain process: gradients of captured batches at any version."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.model = build_job_model(
            JobSpec.from_dict(run.spec),
            num_classes=run.planned["num_classes"],
            sample_shape=run.planned["sample_shape"],
        )  # version 0
        self._scratch = copy.deepcopy(self.model)  # computes gradients at a given version
        self._scratch.train()
        normalize = run.spec["preprocess"]["normalize"]
        self._mean = torch.tensor(normalize["mean"]).view(1, -1, 1, 1)
        self._std = torch.tensor(normalize["std"]).view(1, -1, 1, 1)

    def flat(self) -> torch.Tensor:
        """fp32 [N] copy of the model's parameters."""
        return parameters_to_vector(self.model.parameters()).detach().clone()

    def gradient(self, flat: torch.Tensor, batch_ids: list[str]) -> tuple[torch.Tensor, int]:
        """(fp32 [N] gradient of the summed cross-entropy of ``batch_ids`` at parameters
        ``flat`` [N], accumulated batch after batch; their sample count)."""
        vector_to_parameters(flat, self._scratch.parameters())
        self._scratch.zero_grad(set_to_none=True)
        samples = 0
        for batch_id in batch_ids:
            batch = self.run.batches[batch_id]
            x = (batch.x.to(torch.float32) / 255.0 - self._mean) / self._std  # [B,C,H,W]
            loss = F.cross_entropy(self._scratch(x), batch.y, reduction="sum")
            loss.backward()  # type: ignore[no-untyped-call]
            samples += batch.y.numel()
        grads = [
            p.grad if p.grad is not None else torch.zeros_like(p)
            for p in self._scratch.parameters()
        ]
        return parameters_to_vector(grads), samples


Encode = Callable[[str, torch.Tensor, int], torch.Tensor]
"""(worker id, fp32 [N] summed-loss gradient, samples) -> the fp32 [N] gradient as applied
(compression: encoded by that worker's encoder, decoded)."""


def replay(
    run: Run,
    make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    *,
    lr: float | None = None,
    encode: Encode | None = None,
) -> list[torch.Tensor]:
    """Plain single-process training through the run's StepCloses in version order: the
    flat parameters [N] at every version.

    Each contribution's gradient is computed here, on this replay's own parameters of the
    contribution's base version (sync: the previous version; ssp: up to s versions older),
    its batches in one accumulation; the step's gradient is their sum in the close's order
    (the order of float additions the protocol defines) divided by the step's sample count,
    then one optimizer step over ``model.parameters()`` at the close's lr (``lr``: at this
    one instead). ``encode``: what compression makes of each contribution's gradient, called
    in version order (each worker's contributions in the order it computed them).
    """
    replica = Replica(run)
    params = list(replica.model.parameters())
    optimizer = make_optimizer(params)
    versions = [replica.flat()]
    for version in range(1, run.final_version + 1):
        close = run.closes[version]
        optimizer.zero_grad(set_to_none=True)
        if close.num_samples > 0:  # an empty step makes a version but changes nothing
            step_grad = torch.zeros_like(versions[0])  # [N]
            batch_ids: list[str] = []
            for entry in close.contributions:
                contribution = run.contributions[entry.contribution_id]
                grad, samples = replica.gradient(
                    versions[entry.base_version], contribution.batch_ids
                )
                assert samples == contribution.num_samples == entry.num_samples
                if samples:
                    step_grad += grad if encode is None else encode(entry.worker_id, grad, samples)
                batch_ids += contribution.batch_ids
            assert batch_ids == close.batch_ids, f"version {version}"
            step_grad /= close.num_samples
            offset = 0
            for param in params:
                param.grad = step_grad[offset : offset + param.numel()].view_as(param).clone()
                offset += param.numel()
            for group in optimizer.param_groups:
                group["lr"] = close.lr if lr is None else lr
                if "momentum" in group:  # SGD: the close's, else the job's (set at build)
                    group.setdefault("job_momentum", group["momentum"])
                    group["momentum"] = (
                        group["job_momentum"] if close.momentum is None else close.momentum
                    )
            optimizer.step()
        versions.append(replica.flat())
    return versions


MakeOptimizer = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def replay_local(
    run: Run, make_inner: MakeOptimizer, make_outer: MakeOptimizer
) -> list[torch.Tensor]:
    """Local mode (DiLoCo) in one plain process through the run's StepCloses: the flat
    parameters [N] at every version.

    Each trainer keeps its inner optimizer (``make_inner``, the job's lr) across its windows,
    over one flat parameter [N]; a window starts from this replay's parameters of its base
    version and takes one inner step per entry of ``Contribution.inner_steps`` on the next
    batches of ``batch_ids`` (gradient of their summed loss / their samples). A window with
    ``carried_steps`` (overlap_steps) takes those first steps on the trainer's parameters as
    its previous window ended (``sent``), then moves them onto the base version keeping their
    progress, ``base + (local - sent)``, and takes the rest there. The close's
    outer gradient is the sum of ``(base - local) * num_samples`` over its contributions, in
    the close's order, divided by its num_samples; one outer step (``make_outer``) at the
    close's lr.
    """
    replica = Replica(run)
    versions = [replica.flat()]
    outer_param = nn.Parameter(versions[0].clone())
    outer = make_outer([outer_param])
    inner: dict[str, tuple[nn.Parameter, torch.optim.Optimizer]] = {}
    for version in range(1, run.final_version + 1):
        close = run.closes[version]
        if close.num_samples > 0:
            outer_grad = torch.zeros_like(versions[0])  # [N]
            for entry in close.contributions:
                contribution = run.contributions[entry.contribution_id]
                if entry.num_samples == 0:
                    continue
                if entry.worker_id not in inner:
                    local = nn.Parameter(versions[0].clone())
                    inner[entry.worker_id] = (local, make_inner([local]))
                local, optimizer = inner[entry.worker_id]
                base = versions[entry.base_version]
                sent = local.detach().clone()
                if not contribution.carried_steps:
                    with torch.no_grad():
                        local.copy_(base)
                batch_ids = list(contribution.batch_ids)
                assert sum(contribution.inner_steps) == len(batch_ids), contribution
                samples = 0
                for index, passes in enumerate([*contribution.inner_steps, 0]):
                    if index == contribution.carried_steps > 0:
                        with torch.no_grad():
                            local.copy_(base + (local - sent))
                    if not passes:
                        break  # past the last step: only the move above is left
                    step_batches, batch_ids = batch_ids[:passes], batch_ids[passes:]
                    grad, n = replica.gradient(local.detach().clone(), step_batches)
                    local.grad = grad / n
                    optimizer.step()
                    samples += n
                assert samples == entry.num_samples, f"version {version}"
                outer_grad += (base - local.detach()) * float(samples)
            outer_param.grad = outer_grad / close.num_samples
            for group in outer.param_groups:
                group["lr"] = close.lr
            outer.step()
        versions.append(outer_param.detach().clone())
    return versions


def assert_replays(
    run: Run,
    make_optimizer: MakeOptimizer,
    *,
    lr: float | None = None,
    encode: Encode | None = None,
    replayed: list[torch.Tensor] | None = None,
) -> None:
    """Every published version equals the replay (property 1 of test_gradient_plane.py's
    docstring); ``lr``, ``encode``: see :func:`replay`; ``replayed``: versions replayed
    another way (:func:`replay_local`)."""
    if replayed is None:
        replayed = replay(run, make_optimizer, lr=lr, encode=encode)
    # Version 0 is the same seeded build everywhere: bit-identical.
    assert torch.equal(replayed[0], run.flat_params(0))
    # Same batches, same kernels on one thread, same order of additions: what is left to
    # differ is the rounding of the optimizer's element-wise kernels on one flat slice
    # against per-parameter tensors (vectorised body vs scalar tail: <= 1 ulp per operation),
    # ~1e-7 relative after ~28 steps at most (observed: identical). The bound is tight:
    # one batch applied twice or missing, a wrong lr or divisor moves parameters by > 1e-4.
    final = run.final_version
    for version in range(1, final + 1):
        published = run.flat_params(version)
        diff = (replayed[version] - published).abs().max().item()
        if version in (final // 2, final):
            print(f"{run.job_id} version {version}: max |replay - published| = {diff:.3g}")
        close = torch.allclose(replayed[version], published, rtol=1e-5, atol=1e-6)
        assert close, f"max diff {diff:.3g}\n{explain(run, version)}"
    # It really trained: the last version is far from the first.
    assert (run.flat_params(final) - run.flat_params(0)).abs().max().item() > 1e-2


def explain(run: Run, version: int) -> str:
    """Why ``version`` differs: each contribution's gradient on the wire against the gradient
    of its batches computed here on the published parameters of its base version."""
    close = run.closes[version]
    lines = [f"version {version}: {close}"]
    replica = Replica(run)
    for entry in close.contributions:
        if entry.num_samples == 0:
            continue
        cid = entry.contribution_id
        contribution = run.contributions[cid]
        local, _ = replica.gradient(run.flat_params(entry.base_version), contribution.batch_ids)
        sent = torch.cat([run.grads[(cid, p)].values for p in range(run.num_slices)])
        lines.append(
            f"  {cid} base {entry.base_version} batches {contribution.batch_ids}: "
            f"max |sent - local| = {(sent - local).abs().max().item():.3g} "
            f"(max |local| {local.abs().max().item():.3g})"
        )
    return "\n".join(lines)
