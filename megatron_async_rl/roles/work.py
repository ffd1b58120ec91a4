"""The typed unit of work of one GRPO step, and one rank's typed report of it.

Owned here: `StepWork` (filled stage by stage; each field is None until its stage ran) and
`StepReport` (numbers sorted by how ranks combine them). The generate side (`roles/generate.py`)
fills `cursor`, `records`, `samples`; the learn side (`roles/learn.py`) fills `batch`, `logp_BT`,
`ref_logp_BT`, `adv_B`, `loss_mask_BT`, `report` and `batch_metrics`. Both loops in `jobs/` move
the same objects. Every field is a plain int, float, str, list, dict or tensor, so a step's work
serialises as it is (`state_dict`), the unit a checkpoint saves.

    dataloader      cursor, records                 (generate ranks)
    generate        samples (tokens, engine log-probs, per-token versions), partial
    reward          samples[i].reward, report
    [refill]        refill, held, round_start: more rounds until the batch is complete
    -- samples cross to the Megatron ranks --
    logp            batch, logp_BT                  (logp ranks)
    ref_logp        ref_logp_BT                     (ref ranks)
    train           adv_B, loss_mask_BT, report, batch_metrics   (train ranks)

Shapes: B samples of the step, T the padded sequence length minus one (`rollout/batch.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from megatron_async_rl.engines.protocol import version_number
from megatron_async_rl.rollout.dataset import PromptRecord
from megatron_async_rl.rollout.generation import Sample
from megatron_async_rl.rollout.refill import RefillPlan


@dataclass
class StepReport:
    """One rank's numbers of one step, by how the leader combines them over ranks."""

    means: dict[str, float] = field(default_factory=dict)
    """Averaged over the ranks that report the key (rewards, lengths, grad norm, ...)."""
    sums: dict[str, float] = field(default_factory=dict)
    """Added over ranks: counters and each rank's share of the step's loss."""
    maxima: dict[str, float] = field(default_factory=dict)
    """The largest over ranks: seconds (`timing/*`), the slowest rank bounds the step."""

    def add_means(self, values: Mapping[str, float]) -> StepReport:
        self.means.update(values)
        return self

    def add_sums(self, values: Mapping[str, float]) -> StepReport:
        for key, value in values.items():
            self.sums[key] = self.sums.get(key, 0.0) + value
        return self

    def add_maxima(self, values: Mapping[str, float]) -> StepReport:
        for key, value in values.items():
            self.maxima[key] = max(self.maxima.get(key, value), value)
        return self

    def add_measured(self, values: Mapping[str, float]) -> StepReport:
        """A component's metrics as it reports them: seconds (`timing/...`) as maxima, the
        rest as means (weight sync, scheduler, utilization)."""
        for key, value in values.items():
            if key.startswith("timing/"):
                self.add_maxima({key: value})
            else:
                self.means[key] = value
        return self

    def state_dict(self) -> dict:
        return {"means": dict(self.means), "sums": dict(self.sums), "maxima": dict(self.maxima)}

    @classmethod
    def from_state_dict(cls, state: Mapping) -> StepReport:
        return cls(dict(state["means"]), dict(state["sums"]), dict(state["maxima"]))

    @staticmethod
    def merge(reports: Iterable[StepReport]) -> dict[str, float]:
        """The step's metrics from every rank's report (a key in two kinds is an error)."""
        means: dict[str, list[float]] = {}
        total = StepReport()
        for report in reports:
            for key, value in report.means.items():
                means.setdefault(key, []).append(value)
            total.add_sums(report.sums).add_maxima(report.maxima)
        out = {key: sum(values) / len(values) for key, values in means.items()}
        for kind in (total.sums, total.maxima):
            clash = out.keys() & kind.keys()
            assert not clash, f"metrics reported as two kinds: {sorted(clash)}"
            out.update(kind)
        return out


@dataclass
class StepWork:
    """Everything one step carries from its prompts to its optimizer step."""

    step: int
    """The train step (policy version `step` becomes `step + 1`)."""
    cursor: dict[str, int] | None = None
    """The data cursor (`epoch`, `index`) at the step's first prompt: set by the rank that owns
    the dataset (an engine host), never advanced by any other."""
    records: list[PromptRecord] | None = None
    """The step's prompts; with refill, every round's in draw order until the batch is
    complete, then the trained groups' (`rollout/refill.py`)."""
    samples: list[Sample] | None = None
    """Every engine's samples in prompt order (on an engine host before the exchange: its own;
    with refill, of the round in progress until the batch is complete)."""
    round_start: int = 0
    """Refill: the first record of the round in progress (the generate stage samples
    `records[round_start:]`)."""
    held: list[Sample] | None = None
    """Refill: this host's scored samples of earlier rounds that may be trained."""
    refill: RefillPlan | None = None
    """Refill: the step's plan so far (None without `algorithm.refill`)."""
    partial: bool = False
    """The generation was cut for a checkpoint: `samples` hold each response's prefix so far
    (finish reason "abort" where unfinished), to be continued (`GenerateSide.generate`)."""
    gen_reports: list[StepReport] = field(default_factory=list)
    """The engine hosts' reports of the step (generate, reward, validation, weight loads)."""
    batch: dict[str, torch.Tensor] | None = None
    """`rollout.batch.build_batch` of the samples."""
    logp_BT: torch.Tensor | None = None
    """Log-probs of the policy that generated version `step` (the `logp` role)."""
    ref_logp_BT: torch.Tensor | None = None
    adv_B: torch.Tensor | None = None
    loss_mask_BT: torch.Tensor | None = None
    """The batch's response mask after dynamic filtering."""
    report: StepReport = field(default_factory=StepReport)
    """This rank's report of the step."""
    batch_metrics: dict[str, float] = field(default_factory=dict)
    """Metrics of the whole batch, the same on every Megatron rank (rewards, lengths, lag)."""

    def token_versions(self) -> list[list[int]]:
        """The policy version of every trained response token, per sample (a multi-turn
        trajectory's environment tokens have none)."""
        return [[version_number(v) for v in s.trained_versions()] for s in self.samples]

    def state_dict(self) -> dict:
        """Plain containers and tensors only (`torch.save(..., weights_only)` loads it)."""
        state = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        state["records"] = None if self.records is None else [
            dataclasses.asdict(r) for r in self.records
        ]  # fmt: skip
        state["samples"] = None if self.samples is None else [s.to_dict() for s in self.samples]
        state["held"] = None if self.held is None else [s.to_dict() for s in self.held]
        state["refill"] = None if self.refill is None else self.refill.state_dict()
        state["gen_reports"] = [r.state_dict() for r in self.gen_reports]
        state["report"] = self.report.state_dict()
        return state

    @classmethod
    def from_state_dict(cls, state: Mapping) -> StepWork:
        state = dict(state)
        if state["records"] is not None:
            state["records"] = [PromptRecord(**r) for r in state["records"]]
        if state["samples"] is not None:
            state["samples"] = [Sample(**s) for s in state["samples"]]
        if state.get("held") is not None:
            state["held"] = [Sample(**s) for s in state["held"]]
        if state.get("refill") is not None:
            state["refill"] = RefillPlan.from_state_dict(state["refill"])
        state["gen_reports"] = [StepReport.from_state_dict(r) for r in state["gen_reports"]]
        state["report"] = StepReport.from_state_dict(state["report"])
        return cls(**state)
