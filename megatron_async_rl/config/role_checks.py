"""Checks of the optional roles' checkpoints and switches against the resolved Megatron args.

Owned here: `check_routing_replay` (`moe.routing_replay` needs replayable MoE routers) and
`check_reward_model` (a one-label sequence classifier with the policy's tokenizer). Called by
`recipe.load.build_config` once every role's args are resolved; pure (reads config files).
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_async_rl.config.errors import ConfigError


def check_reward_model(rm_path: str, policy_path: str | None) -> None:
    """The reward model scores the policy's tokens: it must be a one-label
    sequence-classification checkpoint with the policy's tokenizer."""
    key = "reward_model.hf_path"
    config = json.loads((Path(rm_path) / "config.json").read_text())
    kinds = config.get("architectures") or []
    if not any(str(k).endswith("ForSequenceClassification") for k in kinds):
        raise ConfigError(
            key, rm_path, f"has no score head (architectures {kinds})",
            "a reward model is an AutoModelForSequenceClassification checkpoint",
        )  # fmt: skip
    if config.get("num_labels", len(config.get("id2label") or [0])) != 1:
        raise ConfigError(key, rm_path, "must score with one label (num_labels 1)")
    if policy_path is None:
        return
    theirs, ours = _tokenizer_identity(Path(rm_path)), _tokenizer_identity(Path(policy_path))
    policy_vocab = json.loads((Path(policy_path) / "config.json").read_text()).get("vocab_size")
    if theirs != ours or config.get("vocab_size") != policy_vocab:
        raise ConfigError(
            key, rm_path,
            f"has another tokenizer than model.hf_path {policy_path!r} (vocab "
            f"{config.get('vocab_size')} vs {policy_vocab}, or its tokenizer files differ): it "
            "would score token ids it reads otherwise",
            "use a reward model trained on the policy's tokenizer",
        )  # fmt: skip


def _tokenizer_identity(path: Path):
    """What identifies a checkpoint's tokenizer: the token -> id map of its `tokenizer.json`
    (however the file is formatted), else the bytes of its sentencepiece or vocab file."""
    if (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab(with_added_tokens=True)
    for name in ("tokenizer.model", "vocab.json"):
        if (path / name).is_file():
            return (path / name).read_bytes()
    return None


def check_routing_replay(mode: str, resolved: dict, placed) -> None:
    """`moe.routing_replay` needs an MoE model whose routers megatron-core lets us replay."""
    if mode == "off":
        return
    for role in ("train", "logp"):
        if role not in placed:
            continue
        args = resolved[role]
        if not args.get("num_experts"):
            raise ConfigError(
                "moe.routing_replay", mode,
                "replays MoE routing, and the model has no experts (num_experts is unset)",
                "set moe.routing_replay: off for a dense model",
            )  # fmt: skip
        if (args.get("context_parallel_size") or 1) > 1:
            raise ConfigError(
                "moe.routing_replay", mode,
                f"is not laid out for context parallelism (roles.{role}: "
                f"--context-parallel-size {args['context_parallel_size']})",
                "use --context-parallel-size 1, or moe.routing_replay: off",
            )  # fmt: skip
        if args.get("moe_router_fusion"):
            raise ConfigError(
                "moe.routing_replay", mode,
                f"cannot steer Transformer Engine's fused router (roles.{role}: "
                "--moe-router-fusion): megatron-core skips the replay there",
                "drop --moe-router-fusion, or set moe.routing_replay: off",
            )  # fmt: skip
