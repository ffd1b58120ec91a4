"""Token-in/token-out trajectories (`rollout/turns.py`).

Contract: a conversation assembled turn by turn (the prompt's ids, the model's sampled ids
with their end-of-turn token, `observation_ids` of the tool messages, the next turn) is
exactly the chat template's rendering of the whole conversation, token for token, for the
tiny models' template and for a Qwen-style `<|im_start|>` template; environment tokens are
masked out of the loss, carry no log-prob and version -1; `close_turn_ids` adds the template's
end-of-turn tokens the model did not write, and nothing when it wrote them. A real tokenizer
(`models.tiny`), no fake.
"""

from __future__ import annotations

import pytest

from megatron_async_rl.models.tiny import build_tokenizer
from megatron_async_rl.rollout.turns import Trajectory, close_turn_ids, observation_ids

QWEN_STYLE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize("template", ["tiny", "qwen"])
def test_turn_by_turn_equals_the_whole_conversation_rendered(template):
    tok = build_tokenizer()
    if template == "qwen":
        tok.chat_template = QWEN_STYLE
    user = [{"role": "user", "content": "12345+67890=?"}]
    prompt = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    traj = Trajectory(tok.encode(prompt, add_special_tokens=False))
    first, second = "call add(12345, 67890)", "80235"  # characters the tiny vocab has
    tool = [{"role": "tool", "content": "80235"}]
    every_sampled = []
    for turn, text in enumerate((first, second)):
        sampled = tok.encode(text, add_special_tokens=False)  # what the engine returned
        sampled += close_turn_ids(tok, sampled)[:1]  # its stop token, as engines return it
        every_sampled += sampled
        traj.add_model(sampled, [-0.5] * len(sampled), [turn] * len(sampled))
        closing = close_turn_ids(tok, sampled)
        traj.add_environment(closing)
        if turn == 0:
            traj.add_environment(observation_ids(tok, tool))
    whole = [*user, {"role": "assistant", "content": first}, *tool,
             {"role": "assistant", "content": second}]  # fmt: skip
    rendered = tok.apply_chat_template(whole, tokenize=False, add_generation_prompt=False)
    assert traj.context() == tok.encode(rendered, add_special_tokens=False)
    model = [i for i, m in zip(traj.ids, traj.loss_mask, strict=True) if m]
    assert model == every_sampled  # the trained tokens are the sampled ones
    for mask, logprob, version in zip(traj.loss_mask, traj.logprobs, traj.versions, strict=True):
        assert (logprob, version) == ((-0.5, version) if mask else (0.0, -1))
    assert traj.turns == 2 and traj.model_tokens == sum(traj.loss_mask)


def test_close_turn_ids_adds_only_what_is_missing():
    tok = build_tokenizer()
    tok.chat_template = QWEN_STYLE
    closing = tok.encode("<|im_end|>\n", add_special_tokens=False)
    body = tok.encode("7", add_special_tokens=False)
    assert close_turn_ids(tok, body) == closing
    assert close_turn_ids(tok, body + closing[:3]) == closing[3:]
    assert close_turn_ids(tok, body + closing) == []


def test_a_model_turn_needs_a_log_prob_and_version_per_token():
    with pytest.raises(ValueError, match="3 tokens has 2 log-probs and 3 versions"):
        Trajectory([1]).add_model([4, 5, 6], [0.0, 0.0], [1, 1, 1])
