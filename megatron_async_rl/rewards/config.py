"""The recipe's `reward:` section: which reward scores the samples; a pure, validated dataclass.

Owned here: `RewardConfig`, built by the recipe loader (`recipe/schema.py`) and turned into a
reward function by `rewards.registry.get_reward`. Imports only the config checks and the
standard library, so loading a recipe never imports the registry or a reward plug-in.

    reward: {name: math}                                   # a registered name
    reward: {name: my_pkg.rewards:score}                   # module:function
    reward: {name: remote, url: http://127.0.0.1:8000/}    # an HTTP endpoint
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from megatron_async_rl.config.checks import require_choice, require_int, require_number
from megatron_async_rl.config.errors import ConfigError

logger = logging.getLogger(__name__)

REMOTE = "remote"
"""The reward name of the HTTP reward (`rewards.remote`); no registered function may take it."""


@dataclass
class RewardConfig:
    """Which reward scores the samples (recipe section `reward:`)."""

    name: str = "math"
    """A registered name (`math`, `arithmetic`), `module:function`, or `remote`."""
    url: str | None = None
    """`remote` only: the endpoint receiving POST {response, answer, metadata}."""
    timeout_s: float = 10.0
    """`remote` only: seconds to wait for one HTTP answer."""
    max_retries: int = 3
    """`remote` only: retries after the first attempt (timeouts, 5xx, connection errors)."""
    backoff_s: float = 0.5
    """`remote` only: wait before retry i is backoff_s * 2**i."""
    on_failure: str = "zero"
    """What a failed call does (an exception, a timeout, a remote server down after its
    retries, a non-finite value): `zero` scores the sample 0 and counts it (`reward/errors`);
    `stop` stops the run with the reward's error."""
    max_error_rate: float = 0.5
    """Stop the run (one error line, exit 2) when more than this share of one step's samples
    failed to score: a reward that raises on everything would otherwise train on reward 0
    throughout. 1.0: never stop."""
    workers: int = 2
    """`math` only: processes grading with Math-Verify what the fast match leaves undecided
    (`rewards/math_pool.py`), started at the first such answer."""
    call_timeout_s: float | None = None
    """Run the reward in a child process and cut a call after this many seconds (the sample
    scores 0, counted as `reward/timeouts`; the child is killed and a new one started). None:
    the reward runs in the rank's own process, and a call that hangs hangs the run."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ConfigError("name", self.name, "must be a reward name or module:function")
        if self.name == REMOTE:
            if not isinstance(self.url, str) or not self.url.startswith(("http://", "https://")):
                raise ConfigError("url", self.url, "remote reward needs an http:// or https:// URL")
        elif self.url is not None:
            logger.warning("reward.url = %r is ignored: reward.name is %r", self.url, self.name)
        require_number("timeout_s", self.timeout_s, gt=0, unit="seconds")
        require_int("max_retries", self.max_retries, 0)
        require_number("backoff_s", self.backoff_s, ge=0, unit="seconds")
        require_choice("on_failure", self.on_failure, ("zero", "stop"))
        require_number("call_timeout_s", self.call_timeout_s, gt=0, unit="seconds", optional=True)
        require_number("max_error_rate", self.max_error_rate, ge=0, le=1)
        require_int("workers", self.workers, 1)


@dataclass
class RewardModelConfig:
    """A learned reward model scoring the samples (recipe section `reward_model:`; the
    `reward_model` role's ranks run it, frozen)."""

    hf_path: str | None = None
    """An HF `*ForSequenceClassification` checkpoint (one label, Llama/Qwen families): its
    score at the last non-pad token of prompt + response is the sample's model reward."""
    weight: float = 1.0
    """The reward trained on: rule_weight x the `reward:` function's + weight x the model's."""
    rule_weight: float = 1.0
    """Weight of the `reward:` function's value (0: the reward model alone)."""

    def __post_init__(self) -> None:
        if not isinstance(self.hf_path, str) or not self.hf_path:
            raise ConfigError(
                "hf_path", self.hf_path, "must be the reward model's HF directory",
                "an AutoModelForSequenceClassification checkpoint with num_labels 1",
            )  # fmt: skip
        require_number("weight", self.weight)
        require_number("rule_weight", self.rule_weight)
        if self.weight == 0 and self.rule_weight == 0:
            raise ConfigError("weight", self.weight, "and rule_weight are both 0: no reward",
                              "set weight (the model's) or rule_weight (the function's)")
