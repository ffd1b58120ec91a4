"""The recipe's `moe:` section: routing replay and routing metrics; pure (no torch).

Routing replay makes the trainer's MoE layers use the experts the rollout used, so the
log-probs of trainer and engine are computed through the same experts (R3: "Stabilizing MoE RL
by aligning training and inference routers", Ma et al. 2025; verl, slime, SkyRL and NeMo-RL ship
it). Modes:

- `off`: every pass routes on its own.
- `r3`: the engine returns each token's top-k experts per MoE layer; the logp and train passes
  replay them (rollout routing replay).
- `r2`: the logp pass routes on its own and records its choice; the train passes replay it
  (the router of the policy being trained cannot drift within the step's mini-batches).

The reference role always routes on its own (it is another policy). `routing_metrics` compares
the trainer's own top-k set with the engine's on every token of the logp pass
(`moe/routing_agreement`); it needs the engine's routing, so it asks the engines for it too.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_async_rl.config.checks import require_bool, require_choice

ROUTING_REPLAY_MODES = ("off", "r2", "r3")


@dataclass
class MoEConfig:
    """The `moe:` section (error keys relative: `routing_replay`)."""

    routing_replay: str = "off"
    """off, r2 or r3 (see the module docstring)."""
    routing_metrics: bool = True
    """Measure routing agreement with the engine every step (MoE models only)."""

    def __post_init__(self) -> None:
        if self.routing_replay is False:  # YAML 1.1 reads a bare `off` as false
            self.routing_replay = "off"
        if isinstance(self.routing_replay, str):
            self.routing_replay = self.routing_replay.lower()
        require_choice(
            "routing_replay", self.routing_replay, ROUTING_REPLAY_MODES,
            hint="r3 replays the engine's routing in the logp and train passes",
        )  # fmt: skip
        require_bool("routing_metrics", self.routing_metrics)

    @property
    def engine_routing(self) -> bool:
        """Whether the engines must return their routed experts (on an MoE model)."""
        return self.routing_replay == "r3" or self.routing_metrics
