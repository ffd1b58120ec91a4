"""PPO with a critic and a reward model through the real entry point
(`yaml_configs/tiny-ppo-cpu.yaml`, a `reward_model:` section added).

Contracts checked (2 RL steps, the first a critic warm-up step):
- at `generate_ahead_steps: 0` the asynchronous loop on five windows of one rank each (train |
  logp+ref | critic | reward_model | generate) reproduces the synchronous loop on two ranks (every
  Megatron role on one) exactly: every metric but timings is identical at every step (rewards
  with the reward model's scores, GAE's advantages and returns, the critic's value loss,
  gradient norm and explained variance, the actor's loss);
- in the five-window run, every group's utilization is logged, the critic's and the reward
  model's stages run on their own ranks, and the trace shows `critic_train` overlapping the
  actor's `train` at the same step;
- the warm-up trains the critic alone (no actor optimizer step at step 0, one at step 1) and
  the critic's optimizer steps every step;
- its checkpoint holds the critic's model and optimizer next to the actor's, and its HF export
  of the critic loads as `transformers`' `LlamaForTokenClassification`, every weight used.
Nothing is faked: real torchrun, megatron-core, gloo and SGLang on CPU.
"""

import importlib.util
import json
import subprocess

import pytest

from tests.harness.recipes import REPO, launch_command, launch_env

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang not installed"),
]
RECIPE = REPO / "yaml_configs" / "tiny-ppo-cpu.yaml"
SETS = ("trainer.num_steps=2", "critic.warmup_steps=1", "rollout.num_prompts_per_step=8",
        "scheduler.generate_ahead_steps=0",
        "reward.name=tests.e2e.test_ppo_job:odd_first_character")  # fmt: skip
# The weight sync's bucket pool follows the layout (which ranks receive): not compared.
VOLATILE = ("timing/", "throughput/", "scheduler/", "utilization/", "weight_sync/GB_per_s",
            "weight_sync/stall_s", "checkpoint/", "weight_sync/pool_MB")  # fmt: skip


def odd_first_character(response_text: str, answer: str, metadata: dict) -> float:
    """A reward the untrained test model earns about half the time, so returns vary."""
    return float(bool(response_text) and ord(response_text[0]) % 2 == 1)


FIVE_WINDOWS = ("roles.groups=[{roles: [train], num_ranks: 1}, {roles: [logp, ref], num_ranks: 1}, "
                "{roles: [critic], num_ranks: 1}, {roles: [reward_model], num_ranks: 1}, "
                "{roles: [generate], num_ranks: 1}]")  # fmt: skip
ONE_WINDOW = ("roles.groups=[{roles: [train, logp, ref, critic, reward_model], num_ranks: 1}, "
              "{roles: [generate], num_ranks: 1}]")  # fmt: skip
GROUPS = ("train", "logp+ref", "critic", "reward_model", "generate")


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    """A one-label `LlamaForSequenceClassification` with the policy's tokenizer."""
    from megatron_async_rl.models.tiny import write_tiny_model

    out = tmp_path_factory.mktemp("rm") / "llama-rm"
    return write_tiny_model(out, "llama", seed=1, task="sequence_classification")


def _run(task, run_dir, *sets, nproc=2) -> list[dict]:
    sets = (f"model.hf_path={task.model}", f"data.path={task.data}", *SETS, *sets)
    proc = subprocess.run(launch_command(RECIPE, run_dir, *sets), env=launch_env(nproc),
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-5000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _stable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE)}


def _spans(run_dir) -> list[dict]:
    trace = json.loads((run_dir / "trace.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X"]


RANKS = {"train": 0, "logp": 1, "ref": 1, "critic": 2, "reward_model": 3}
"""The five-window layout's rank of each Megatron role (generate is rank 4)."""


def _overlap(spans, stage: str, role: str, others: dict[str, str], step: int) -> float:
    """Seconds the span of `stage` on `role`'s rank at `step` overlaps the spans of `others`
    (stage -> the role whose rank runs it) at the same step."""
    mine = [e for e in spans if e["name"] == stage and e["pid"] == RANKS[role]
            and e["args"].get("step") == step]  # fmt: skip
    assert len(mine) == 1, (stage, step, mine)
    a0, a1 = mine[0]["ts"], mine[0]["ts"] + mine[0]["dur"]
    return sum(
        max(0.0, min(a1, e["ts"] + e["dur"]) - max(a0, e["ts"])) / 1e6
        for e in spans
        if e["name"] in others and e["pid"] == RANKS[others[e["name"]]]
        and e["args"].get("step") == step
    )  # fmt: skip


def test_ppo_with_a_reward_model_async_on_five_windows_is_the_synchronous_loop(
    task, reward_model, tmp_path
):
    rm = (f"reward_model.hf_path={reward_model}", "reward_model.weight=0.5")
    sync = _run(task, tmp_path / "sync", ONE_WINDOW, *rm, "checkpoint.hf_export_every=2")
    async_ = _run(task, tmp_path / "async", FIVE_WINDOWS, *rm, "scheduler.loop=async",
                  nproc=5)  # fmt: skip
    assert len(sync) == len(async_) == 2
    for a, b in zip(sync, async_, strict=True):
        assert _stable(a) == _stable(b)
    assert "actor/optimizer_steps" not in sync[0] and sync[1]["actor/optimizer_steps"] == 1.0
    for row in sync:
        assert row["critic/optimizer_steps"] == 1.0
        assert row["critic/value_loss"] > 0 and row["critic/grad_norm"] > 0
        assert "critic/explained_var" in row and "timing/critic_train_s" in row
        mixed = row["reward/rule/mean"] + 0.5 * row["reward_model/score/mean"]
        assert row["reward/mean"] == pytest.approx(mixed, abs=1e-5)
        assert row["reward_model/score/std"] > 0
    for row in async_:
        for group in GROUPS:
            assert f"utilization/{group}/busy_s" in row, (group, sorted(row))
    spans = _spans(tmp_path / "async")
    # The critic trains while the actor trains (both start after the train stage's gather).
    # critic_values and reward_model have no dependency on logp/ref either, but here they take
    # ~10 ms and the samples reach the ranks tens of ms apart: their overlap is not asserted.
    assert _overlap(spans, "critic_train", "critic", {"train": "train"}, 1) > 0
    for stage, role in (("critic_values", "critic"), ("reward_model", "reward_model")):
        ran = [e for e in spans if e["name"] == stage and e["pid"] == RANKS[role]]
        assert len(ran) == 2 and all(e["dur"] > 0 for e in ran), (stage, ran)
    saved = sorted((tmp_path / "sync" / "checkpoints").glob("step_*"))
    assert saved and (saved[-1] / "critic").is_dir() and (saved[-1] / "megatron").is_dir()
    _check_critic_export(tmp_path / "sync" / "checkpoints" / "hf_step_00000002_critic", task)


def _check_critic_export(path, task) -> None:
    """The trained critic loads as `transformers`' token classifier, every weight used, its
    value head trained away from its zero init."""
    import transformers

    model, info = transformers.AutoModelForTokenClassification.from_pretrained(
        path, output_loading_info=True
    )
    assert type(model).__name__ == "LlamaForTokenClassification" and model.num_labels == 1
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.score.weight.abs().sum() > 0
    tokens = transformers.AutoTokenizer.from_pretrained(path)("1+2=3", return_tensors="pt")
    assert model(**tokens).logits.shape[-1] == 1
