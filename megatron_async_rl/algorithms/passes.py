"""Which forward passes a step runs besides training: the old log-probs and the reference's.

Owned here, pure (no model, no process group):
- `resolve_old_logprobs`: where a step's old log-probs come from
  (`algorithm.old_logprobs`), with `auto` resolved, and every combination that cannot work
  refused, naming the key.
  - logp: the `logp` role's pass over the batch, with the weights that generated it. This is
    the proximal policy of decoupled PPO, and what several optimizer steps per RL step need.
  - trainer: no pass. The train forward's own log-probs, detached, are the old ones. That is
    exact where the step trains once on samples of the version it holds: synchronous (or zero
    steps ahead), one optimizer step per RL step.
  - engine: no pass. The engine's log-probs (the behaviour policy) are the old ones. The PPO
    ratio is then taken against the policy that sampled, so the clip also bounds the
    engine-trainer mismatch.
  - auto: logp where the role is placed, else trainer where exact, else engine.
- `ref_needed` / `ref_runs`: the reference pass runs when a KL term needs it (every step), or,
  with a placed ref role and no KL term, every `algorithm.kl_metrics_every` steps for the
  `kl/*` metrics.
- `unused_roles`: placed roles nothing runs (the dry run's warnings).
- `describe`: the dry run's lines.
"""

from __future__ import annotations

from megatron_async_rl.config.errors import ConfigError


def ref_needed(algo) -> bool:
    """A KL term (in the loss or the reward) needs the reference policy every step."""
    return algo.kl_coef > 0


def ref_runs(algo, step: int) -> bool:
    """Whether step `step` runs the placed ref role's pass."""
    if ref_needed(algo):
        return True
    return algo.kl_metrics_every > 0 and step % algo.kl_metrics_every == 0


def resolve_old_logprobs(algo, placed, generate_ahead_steps: int, optimizer_steps: int,
                         routing_replay: str = "off") -> str:  # fmt: skip
    """`algorithm.old_logprobs` resolved against the run (`auto` -> logp, trainer or engine);
    ConfigError where the choice cannot give what the algorithm needs."""
    mode = algo.old_logprobs
    exact = generate_ahead_steps == 0 and optimizer_steps == 1
    if mode == "auto":
        mode = "logp" if "logp" in placed else "trainer" if exact and \
            not _trainer_conflicts(algo, routing_replay) else "engine"  # fmt: skip
    key = "algorithm.old_logprobs"
    if mode == "logp" and "logp" not in placed:
        raise ConfigError(
            key, "logp", "takes the old log-probs from the logp role, and none is placed",
            "place logp (e.g. {roles: [train, logp], ...}), or use old_logprobs: trainer or "
            "engine",
        )  # fmt: skip
    if mode != "logp" and algo.off_policy_correction == "decoupled":
        raise ConfigError(
            key, mode,
            "decoupled PPO (algorithm.off_policy_correction: decoupled) needs the proximal "
            "policy's log-probs, which only the logp role's pass gives",
            "use old_logprobs: logp (and place a logp role)",
        )  # fmt: skip
    if mode != "logp" and routing_replay == "r2":
        raise ConfigError(
            key, mode, "moe.routing_replay r2 replays the routing the logp pass records",
            "use old_logprobs: logp, or moe.routing_replay r3 (the engines' routing)",
        )  # fmt: skip
    if mode == "trainer":
        if not exact:
            raise ConfigError(
                key, "trainer",
                f"is exact only for one optimizer step on samples of the version being trained "
                f"(scheduler.generate_ahead_steps {generate_ahead_steps}, {optimizer_steps} "
                "optimizer steps per RL step)",
                "use old_logprobs: logp or engine, or one optimizer step (no "
                "--global-batch-size below the rollout batch, algorithm.ppo_epochs 1) at zero "
                "steps ahead",
            )  # fmt: skip
        conflict = _trainer_conflicts(algo, routing_replay)
        if conflict:
            raise ConfigError(key, "trainer", conflict, "use old_logprobs: logp or engine")
    return mode


def _trainer_conflicts(algo, routing_replay: str) -> str | None:
    """What needs the old log-probs before the train step (None: nothing)."""
    if algo.kl_coef > 0 and algo.kl_mode == "reward":
        return "the KL penalty in the reward (algorithm.kl_mode: reward) needs the old " \
            "log-probs before the train step"  # fmt: skip
    if algo.off_policy_mask != "none":
        return f"the off-policy mask (algorithm.off_policy_mask: {algo.off_policy_mask}) " \
            "rejects tokens before the train step, by the old log-probs"  # fmt: skip
    if algo.advantage_estimator == "gae" and algo.kl_coef > 0:
        return "PPO's per-token KL reward needs the old log-probs before the train step"
    return None


def unused_roles(cfg) -> list[str]:
    """Placed roles no pass of the run uses, each with why (the dry run warns)."""
    placed, algo = cfg.roles.placed_roles(), cfg.algorithm
    unused = []
    if "ref" in placed and not ref_needed(algo) and algo.kl_metrics_every == 0:
        unused.append("ref: no KL term (algorithm.kl_coef 0) and algorithm.kl_metrics_every 0: "
                      "the reference model is loaded and never run; drop it from "
                      "roles.groups")  # fmt: skip
    if "logp" in placed and algo.old_logprobs != "logp":
        unused.append(f"logp: algorithm.old_logprobs is {algo.old_logprobs}: the role is "
                      "loaded and kept in sync and never run; drop it from "
                      "roles.groups")  # fmt: skip
    return unused


def describe(cfg) -> str:
    """The dry run's account of the passes a step runs."""
    algo, placed = cfg.algorithm, cfg.roles.placed_roles()
    old = {
        "logp": "the logp role's pass (old policy, the weights that generated the samples)",
        "trainer": "the train forward's own, detached (no extra pass: one optimizer step on "
                   "samples of the version it holds)",
        "engine": "the engine's (behaviour policy; no extra pass)",
    }[algo.old_logprobs]  # fmt: skip
    if "ref" not in placed:
        ref = "not placed (no KL term): no reference model resident, no kl/* metrics"
    elif ref_needed(algo):
        ref = f"every step (KL term in the {algo.kl_mode}, kl_coef {algo.kl_coef:g})"
    elif algo.kl_metrics_every:
        ref = f"every {algo.kl_metrics_every} step(s), for the kl/* metrics only (kl_coef 0)"
    else:
        ref = "never (kl_coef 0, kl_metrics_every 0)"
    lines = ["passes per step besides training:", f"  old log-probs: {old}",
             f"  reference log-probs: {ref}"]  # fmt: skip
    lines += [f"  warning: {why}" for why in unused_roles(cfg)]
    return "\n".join(lines)
