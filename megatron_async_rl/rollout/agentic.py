"""The generate stage's multi-turn path: a step's prompts to trajectories, as `Sample`s.

Owned here: `MultiTurnRollout`, built from the recipe's `environment:` section on an engine-host
rank (the tool runner's worker processes and the environment factory), and its `samples(...)`,
which the generate stage calls instead of `generation.generate_samples` when the section is
set. Each of the engine's prompts is sampled `n` times as whole trajectories
(`multiturn.generate_trajectories`: turn-batched on the engine, environments stepped
concurrently); a trajectory becomes one `Sample` whose `response_ids` are every token after
the prompt, model and environment tokens alike, with `loss_mask` 1 on model tokens only, the
engine's log-probs and weight versions on those (the environment's tokens get 0.0 and ""), and
the final answer as `response_text` (what the run's reward function scores). GRPO groups are the
`n` trajectories of a prompt. The environment's own reward is `metadata["env_reward"]`.

The built-in `tools` environment gets the tools' JSON schemas in the prompt's chat template
(`tools=`); its final answer is scored by the run's reward function (`reward_fn_weight`).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import replace
from typing import Any

from megatron_async_rl.rollout.config import EnvironmentConfig, RolloutConfig
from megatron_async_rl.rollout.environment import EpisodeSample, ToolEnvironment, load_environment
from megatron_async_rl.rollout.generation import Sample, request_seed
from megatron_async_rl.rollout.multiturn import MultiTurnLimits, generate_trajectories
from megatron_async_rl.rollout.tool_calls import decodes_special_tokens


def version_label(number: int) -> str:
    """The engine's label of policy version `number` (`protocol.version_number`'s inverse)."""
    from megatron_async_rl.engines.protocol import INITIAL_VERSION

    return INITIAL_VERSION if number == 0 else f"v{number}"


class MultiTurnRollout:
    """The environments and tools of one generate rank (see the module docstring)."""

    def __init__(self, cfg: EnvironmentConfig):
        self.cfg = cfg
        self.runner = None
        self.tool_schemas: list[dict] | None = None
        if cfg.name == "tools":
            from megatron_async_rl.rollout.tools import ToolRunner, load_tools

            tools = load_tools(cfg.tools, key="environment.tools")
            self.tool_schemas = [tool.schema for tool in tools.values()]
            self.runner = ToolRunner(tools, cfg.tool_workers, cfg.tool_timeout_s,
                                     cfg.tool_max_chars, cfg.sandbox)  # fmt: skip
            self.make_env = lambda: ToolEnvironment(self.runner, None, cfg.tool_format)
        else:
            self.make_env = load_environment(cfg.name, "environment.name", **cfg.kwargs)
        keep_special = cfg.name == "tools" and decodes_special_tokens(cfg.tool_format)
        if keep_special:  # SGLang's detectors: imported now, not at the first turn (~10 s)
            import sglang.srt.function_call.function_call_parser  # noqa: F401
        self.limits = MultiTurnLimits(cfg.max_turns, cfg.max_total_tokens, cfg.step_timeout_s,
                                      keep_special_tokens=keep_special)  # fmt: skip

    def encode(self, record, tokenizer, use_chat_template: bool) -> list[int]:
        """A prompt's ids, with the tools in its chat template."""
        from megatron_async_rl.rollout.dataset import encode_prompt

        return encode_prompt(record, tokenizer, use_chat_template, tools=self.tool_schemas)

    def samples(self, engine, tokenizer, records, prompt_ids: dict[int, list[int]],
                indices: list[int], num_samples: int, rollout: RolloutConfig, *, step: int,
                run_seed: int, should_stop=None, trace=None,
                ) -> tuple[list[Sample], dict[str, float]]:  # fmt: skip
        """`num_samples` trajectories for each prompt in `indices`, as Samples, and the step's
        sums for the report (`multiturn/...`). `should_stop()`: true when the stage was cut
        (then `multiturn.Cut` is raised). `trace`: a `TraceRecorder` that gets an
        `environment` span per turn (the environments of a turn stepping together)."""
        from megatron_async_rl.engines.protocol import EngineLimits, ManagedEngine, SamplingParams

        stop = (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
        owners, episode_samples, ids, sampling = [], [], [], []
        for index in indices:
            record = records[index]
            for k in range(num_samples):
                owners.append((index, k))
                episode_samples.append(EpisodeSample(
                    record.messages if record.messages is not None else record.prompt_text,
                    record.answer, record.reward_metadata()))  # fmt: skip
                ids.append(prompt_ids[index])
                sampling.append(SamplingParams(
                    max_new_tokens=rollout.max_new_tokens, temperature=float(rollout.temperature),
                    top_p=float(rollout.top_p), top_k=rollout.top_k,
                    seed=request_seed(run_seed, step, record.uid, k), stop_token_ids=stop,
                ))  # fmt: skip
        calls_before = Counter(self.runner.counts) if self.runner else Counter()
        start = time.perf_counter()
        limits = self.limits
        inner = engine.inner if isinstance(engine, ManagedEngine) else engine  # serving now
        if isinstance(inner, EngineLimits):
            limits = replace(limits, max_context_tokens=inner.context_tokens,
                             max_input_tokens=inner.max_input_tokens)  # fmt: skip
        trajectories, episodes, counts = generate_trajectories(
            engine, tokenizer, self.make_env, episode_samples, ids, sampling, limits,
            rid_prefix=f"s{step}", should_stop=should_stop,
            on_env_span=None if trace is None else (
                lambda start, end: trace.add("environment", start, end, step=step)),
        )  # fmt: skip
        samples = []
        for (index, k), trajectory, episode in zip(owners, trajectories, episodes, strict=True):
            record = records[index]
            metadata = record.reward_metadata()
            metadata.update(env_reward=episode.reward, turns=trajectory.turns,
                            finish=episode.finish_reason, env_error=episode.error)  # fmt: skip
            samples.append(Sample(
                uid=record.uid, prompt_index=index, sample_index=k,
                prompt_ids=list(prompt_ids[index]), response_ids=list(trajectory.ids),
                response_logprobs=list(trajectory.logprobs),
                token_versions=[version_label(v) if m else ""
                                for v, m in zip(trajectory.versions, trajectory.loss_mask)],
                finish_reason="length" if episode.finish_reason in ("budget", "max_turns")
                else "stop",
                answer=record.answer, metadata=metadata,
                response_text=episode.actions[-1] if episode.actions else "",
                loss_mask=list(trajectory.loss_mask),
            ))  # fmt: skip
        return samples, self._metrics(samples, counts, calls_before, time.perf_counter() - start)

    def _metrics(self, samples, counts: Counter, calls_before: Counter, env_s: float) -> dict:
        calls = (Counter(self.runner.counts) - calls_before) if self.runner else Counter()
        # sandbox outcomes are counted on their own (a limit hit is also an error to the model)
        errors = sum(v for k, v in calls.items()
                     if k not in ("calls", "truncated") and not k.startswith("sandbox_"))
        stopped = ("sandbox_wall", "sandbox_cpu", "sandbox_output", "sandbox_unavailable")
        errors += sum(calls[k] for k in stopped)
        masked = sum(len(s.loss_mask) - sum(s.loss_mask) for s in samples)
        total = sum(len(s.loss_mask) for s in samples)
        return {
            "multiturn/trajectories": float(len(samples)),
            "multiturn/turns": float(counts["turns"]),
            "multiturn/tool_calls": float(calls["calls"]),
            "multiturn/tool_errors": float(errors + counts["malformed_calls"]),
            "multiturn/tool_results_truncated": float(calls["truncated"]),
            "multiturn/env_errors": float(counts["env_errors"]),
            "multiturn/env_timeouts": float(counts["env_timeouts"]),
            "multiturn/budget_ends": float(counts["budget"]),
            "multiturn/observations_too_long": float(counts["observation_too_long"]),
            "multiturn/env_s": float(counts["env_s"]),
            "multiturn/rollout_s": env_s,
            "multiturn/masked_tokens": float(masked),
            "multiturn/tokens": float(total),
            **{f"multiturn/{k}": float(v) for k, v in calls.items() if k.startswith("sandbox_")},
        }

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()


def mixed_reward(sample: Sample, fn_value: float, weight: float) -> float:
    """A trajectory's reward: its environment's rewards plus `weight` x the reward function's
    value on its final answer; a failed environment scores 0 (`Episode.reward`)."""
    if sample.metadata.get("env_error"):
        return 0.0
    return float(sample.metadata.get("env_reward", 0.0)) + weight * float(fn_value)


def ratio_metrics(sums: dict[str, Any]) -> dict[str, float]:
    """Means from the step's summed counts (`turns_mean`, `tool_calls_mean`,
    `masked_token_frac`), for the progress line and the metric files."""
    n = sums.get("multiturn/trajectories") or 0.0
    out = {}
    if n:
        out["multiturn/turns_mean"] = sums.get("multiturn/turns", 0.0) / n
        out["multiturn/tool_calls_mean"] = sums.get("multiturn/tool_calls", 0.0) / n
    if sums.get("multiturn/tokens"):
        masked, tokens = sums.get("multiturn/masked_tokens", 0.0), sums["multiturn/tokens"]
        out["multiturn/masked_token_frac"] = masked / tokens
    return out
