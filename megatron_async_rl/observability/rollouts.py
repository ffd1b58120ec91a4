"""Rollouts a person can read: one JSONL file per dumped step (`observability.dump_rollouts_every`).

Owned here: `dump_rollouts`, called by the learn side's leader when it logs a step. Each line is
one sample: its uid, the decoded prompt and response, the row's answer, the reward and the GRPO
advantage it was trained with, why generation stopped, and the weight versions of its tokens
(oldest, newest): what a user reads to see what the policy does and how it is scored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def dump_rollouts(
    run_dir: str | Path, step: int, samples: list, advantages, versions: list, tokenizer: Any
) -> Path:
    """Write `<run_dir>/rollouts/step_<step>.jsonl` (`advantages`, `versions`: one per sample,
    in order; `versions` the policy version of each response token)."""
    out = Path(run_dir) / "rollouts" / f"step_{step:08d}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    advantages = [float(a) for a in advantages]
    with out.open("w") as handle:
        for sample, advantage, tokens in zip(samples, advantages, versions, strict=True):
            prompt = tokenizer.decode(sample.prompt_ids) if tokenizer is not None else None
            row = {
                "step": step, "uid": sample.uid, "sample": sample.sample_index,
                "prompt": prompt, "response": sample.response_text, "answer": sample.answer,
                "reward": sample.reward, "advantage": advantage,
                "finish_reason": sample.finish_reason,
                "versions": [min(tokens), max(tokens)] if tokens else None,
            }  # fmt: skip
            if sample.loss_mask is not None:  # a multi-turn trajectory: the whole conversation
                row.update(_conversation(sample, tokenizer))
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    return out


def _conversation(sample, tokenizer) -> dict:
    """A trajectory's turns as `[{"by": "model"|"environment", "text": ...}]` (runs of equal
    loss mask), its final answer as `response`, its turns and environment reward."""
    runs: list[tuple[int, list[int]]] = []
    for token, mask in zip(sample.response_ids, sample.loss_mask, strict=True):
        if runs and runs[-1][0] == mask:
            runs[-1][1].append(token)
        else:
            runs.append((mask, [token]))
    text = (lambda ids: tokenizer.decode(ids, skip_special_tokens=False)) if tokenizer else str
    meta = sample.metadata or {}
    return {
        "conversation": [{"by": "model" if m else "environment", "text": text(ids)}
                         for m, ids in runs],  # fmt: skip
        "turns": meta.get("turns"),
        "env_reward": meta.get("env_reward"),
        "env_finish": meta.get("finish"),
    }
