"""How samples and weights cross between the generate side and the learn side.

Owned here: the `Exchange` interface and its two implementations.

- `GlooExchange`: the ranks of a `torch.distributed` world; samples over the `samples` group
  (object all-gather), weights through `weight_sync` (reshard, stream, checksum).
- `LocalExchange`: one process; in-process queues, weights handed over as tensors. The whole
  asynchronous pipeline (scheduler threads, staleness admission, in-flight loads, validation
  gating, timeouts) runs on it in unit tests, with `FakeEngine` and a stand-in learner.

    generate side                              learn side
    send_step(work)                --------->  receive_step(s) -> StepWork   (asynchronous loop)
    receive_weights(v) -> tensors  <---------  sync_weights(v)
    share_step / weights_ready / sync_weights(v, engine)                     (synchronous loop)

A step crosses as its data cursor, samples and the engine host's report; the learn side gets a
`StepWork` of its own. In the synchronous loop every rank makes the same calls in the same order
(`share_step`:
each contributes its own samples, all get every engine's; `sync_weights(v, engine)`: train ranks
send, engines and the logp role load). In the asynchronous loop each side calls its half, one
thread per direction (the generate rank's sender and weight threads, the learn rank's receiver
and scheduler threads), so a blocking transfer never stalls a scheduler.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from megatron_async_rl.distributed import devices
from megatron_async_rl.roles.work import StepReport, StepWork
from megatron_async_rl.rollout.generation import Sample
from megatron_async_rl.scheduler.states import StageTimeout
from megatron_async_rl.weight_sync.broadcast import broadcast_weights, sync_weights, warm_up
from megatron_async_rl.weight_sync.buffers import BufferPool
from megatron_async_rl.weight_sync.sinks import load_into_engine


class Exchange(Protocol):
    def share_step(self, work: StepWork | None, step: int) -> StepWork:
        """Collective: each engine host gives its `work` of `step` (others None); every rank
        gets the learn side's `StepWork`: every engine's samples in prompt order, the hosts'
        reports and the step's data cursor."""

    def send_step(self, work: StepWork) -> None:
        """An engine host hands its samples of a step to the learn side."""

    def receive_step(self, step: int) -> StepWork:
        """The learn side takes the samples of `step` (as `share_step` gives them)."""

    def weights_ready(self) -> None:
        """Wait until every participant of the next weight sync has reached it."""

    def sync_weights(self, version: int, engine=None) -> dict[str, float]:
        """The train role's weights become `version` on the receivers; this rank's metrics."""

    def receive_weights(self, version: int) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """An engine host receives `version` whole (generation may go on meanwhile)."""


def _payload(work: StepWork | None):
    if work is None:
        return None
    return work.cursor, [s.to_dict() for s in work.samples], work.report.state_dict()


def _learn_work(step: int, payloads: list) -> StepWork:
    """The learn side's work of `step` from the engine hosts' payloads."""
    sent = [p for p in payloads if p is not None]
    samples = sorted(
        (Sample(**d) for _, dicts, _ in sent for d in dicts),
        key=lambda s: (s.prompt_index, s.sample_index),
    )
    return StepWork(
        step=step,
        cursor=sent[0][0] if sent else None,
        samples=samples,
        gen_reports=[StepReport.from_state_dict(report) for _, _, report in sent],
    )


class GlooExchange:
    """The exchange between the ranks of one world (its groups, this rank's roles)."""

    def __init__(self, groups, roles: dict, weight_sync_config, device: torch.device):
        self.groups, self.roles, self.config = groups, roles, weight_sync_config
        self.device = device
        """The rank's device (`Platform.device()`), decided on the main thread."""
        self.pool = BufferPool()
        """This rank's weight-sync buffers, reused from one version to the next."""
        self.tamper = None
        """Fault injection on received weight messages (`faults.weight_corrupt_versions`)."""

    def share_step(self, work, step):
        groups = self.groups
        if groups.samples is None:  # an engine follower: not in the group
            return StepWork(step=step, samples=[])
        parts = [None] * dist.get_world_size(groups.samples)
        devices.all_gather_object(parts, _payload(work), group=groups.samples)
        return _learn_work(step, parts)

    def send_step(self, work):
        self.share_step(work, work.step)

    def receive_step(self, step):
        return self.share_step(None, step)

    def weights_ready(self):
        if self.groups.weight_sync is not None:
            dist.barrier(group=self.groups.weight_sync)

    def warm_up(self, streaming: bool, staging: bool) -> dict[str, float]:
        """Start-up, before engines start (collective): `broadcast.warm_up`."""
        return warm_up(
            self.groups, self.roles, self.config, self.pool, self.device, streaming, staging
        )

    def sync_weights(self, version, engine=None):
        return sync_weights(
            self.groups, self.roles, engine, version, self.config, self.pool, self.device,
            self.tamper,
        )  # fmt: skip

    def receive_weights(self, version):
        devices.bind_thread(self.device)  # the engine host's weight thread
        return broadcast_weights(
            self.groups, {}, self.config, version, self.pool, self.device, self.tamper
        )


class LocalExchange:
    """Both sides in one process: queues between threads; weights as `state()` gives them.

    `state()` returns the learner's weights by engine name (a stand-in learner's dict of
    tensors); they are copied when sent, as a real transfer would.
    """

    def __init__(self, state: Callable[[], dict[str, torch.Tensor]], timeout_s: float = 60.0):
        self.state, self.timeout_s = state, timeout_s
        self._samples: queue.Queue = queue.Queue()
        self._weights: queue.Queue = queue.Queue()

    def share_step(self, work, step):
        return _learn_work(step, [_payload(work)])

    def send_step(self, work):
        self._samples.put(_payload(work))

    def receive_step(self, step):
        try:
            payload = self._samples.get(timeout=self.timeout_s)
        except queue.Empty:
            raise StageTimeout(f"the samples of step {step}", self.timeout_s, self.timeout_s,
                               {"role": "learn", "stage": "receive"}) from None  # fmt: skip
        return _learn_work(step, [payload])

    def weights_ready(self):
        return None

    def sync_weights(self, version, engine=None):
        tensors = {name: t.detach().clone() for name, t in self.state().items()}
        if engine is not None:
            load_into_engine(engine, tensors, version)
        else:
            self._weights.put((version, tensors))
        return {}

    def receive_weights(self, version):
        try:
            sent, tensors = self._weights.get(timeout=self.timeout_s)
        except queue.Empty:
            raise StageTimeout(f"weights v{version}", self.timeout_s, self.timeout_s,
                               {"role": "generate", "stage": "param_update"}) from None  # fmt: skip
        if sent != version:
            raise RuntimeError(f"local exchange: expected weights v{version}, got v{sent}")
        return tensors, {}
