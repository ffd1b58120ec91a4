"""Token-in/token-out multi-turn trajectories: the tokens trained are the tokens sampled.

Owned here: `Trajectory` (one conversation as token ids after the prompt, with a loss mask,
engine log-probs and per-token policy versions) and `observation_ids` (the tokens a chat
template puts between the assistant's turn and its next one for the environment's messages).

Each turn continues from the token ids of the conversation so far: the model's tokens are
appended as sampled (mask 1, their log-probs and versions), and the environment's messages as
the template renders them (mask 0, no log-prob, version -1): nothing is detokenised and
tokenised again, so a token the policy sampled is never replaced by another tokenisation of
the same text. `observation_ids` renders the messages after an assistant turn and keeps what
the template adds after that turn's end; when the model stopped without the template's
end-of-turn tokens (a stop string, the length limit), `close_turn_ids` supplies them, masked.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

_ANCHOR = "\x00anchor\x00"
"""A placeholder assistant message: the template's rendering after it is what we keep."""


@dataclass
class Trajectory:
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    """The tokens after the prompt: model and environment tokens, in order."""
    loss_mask: list[int] = field(default_factory=list)
    """1: a model token (trained); 0: an environment token (not trained)."""
    logprobs: list[float] = field(default_factory=list)
    """The engine's log-prob of each model token; 0.0 for environment tokens."""
    versions: list[int] = field(default_factory=list)
    """The policy version that sampled each model token; -1 for environment tokens."""
    turns: int = 0

    def add_model(self, ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        if not len(ids) == len(logprobs) == len(versions):
            raise ValueError(f"a model turn of {len(ids)} tokens has {len(logprobs)} "
                             f"log-probs and {len(versions)} versions")  # fmt: skip
        self.ids += ids
        self.loss_mask += [1] * len(ids)
        self.logprobs += [float(x) for x in logprobs]
        self.versions += [int(v) for v in versions]
        self.turns += 1

    def add_environment(self, ids: list[int]) -> None:
        self.ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def context(self) -> list[int]:
        """What the engine continues from: the prompt and everything after it."""
        return self.prompt_ids + self.ids

    @property
    def model_tokens(self) -> int:
        return sum(self.loss_mask)


def observation_ids(tokenizer: Any, messages: list[dict], calls: list[dict] | None = None
                    ) -> list[int]:  # fmt: skip
    """The tokens the chat template puts after an assistant turn for `messages` (tool results,
    a user's reply), ending with the prompt of the next assistant turn.

    `calls`: the turn's tool calls, OpenAI's form (`{"id", "type": "function", "function":
    {"name", "arguments"}}`), for templates that render a tool message from its call (gpt-oss
    names the function, Mistral's matches the call's id). Their arguments are tried as an
    object (transformers' form, Qwen3-Coder's template), then as a JSON string (DeepSeek's
    templates), then the turn is rendered without them; the first rendering that works is
    kept. The model's own tokens stand for the turn: only what follows it is returned."""
    failure: Exception | None = None
    for anchor in _anchors(calls):
        try:
            before = _render(tokenizer, [anchor], False)
            after = _render(tokenizer, [anchor, *messages], True)
        except Exception as err:  # noqa: BLE001 - jinja's TemplateError, a filter's TypeError
            failure = err
            continue
        if not after.startswith(before):
            raise ValueError("the chat template renders an assistant turn differently "
                             "when messages follow it: observation tokens cannot be "
                             "appended")  # fmt: skip
        return tokenizer.encode(after[len(before) :], add_special_tokens=False)
    raise ValueError(f"the chat template cannot render the environment's messages after an "
                     f"assistant turn: {failure}") from failure  # fmt: skip


def _anchors(calls: list[dict] | None):
    if calls:
        yield {"role": "assistant", "content": _ANCHOR, "tool_calls": calls}
        as_text = [{**c, "function": {**c["function"],
                                      "arguments": json.dumps(c["function"]["arguments"])}}
                   for c in calls]  # fmt: skip
        yield {"role": "assistant", "content": _ANCHOR, "tool_calls": as_text}
    yield {"role": "assistant", "content": _ANCHOR}


def openai_calls(calls: list[Any]) -> list[dict]:
    """`ToolCall`s as a chat template's `tool_calls`, with ids `call00001`, ... (9 characters,
    what Mistral's templates require)."""
    return [{"id": f"call{i:05d}", "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}}
            for i, c in enumerate(calls, 1)]  # fmt: skip


def close_turn_ids(tokenizer: Any, response_ids: list[int]) -> list[int]:
    """The end-of-turn tokens the template writes after an assistant message that the model's
    `response_ids` lack (none when it ended with them itself)."""
    rendered = _render(tokenizer, [{"role": "assistant", "content": _ANCHOR}], False)
    closing = tokenizer.encode(rendered.split(_ANCHOR, 1)[1], add_special_tokens=False)
    for overlap in range(len(closing), 0, -1):  # the longest part of it the model wrote
        if response_ids[-overlap:] == closing[:overlap]:
            return closing[overlap:]
    return closing


def _render(tokenizer: Any, messages: list[dict], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)  # fmt: skip
