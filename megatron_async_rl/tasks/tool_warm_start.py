"""Supervised warm start for tool use: teach a tiny model the CALL FORMAT, not the task.

Owned here: `tool_warm_start` and its command line, run once before the tool-use recipe
(`yaml_configs/tiny-tools-cpu.yaml`, `scripts/tools_quickstart.sh`):

    python -m megatron_async_rl.tasks.tool_warm_start --model runs/tiny-llama \\
        --data runs/calc/train.jsonl --out runs/tiny-llama-tools-warm

Each training example is the whole conversation the rollout builds, token for token: the
prompt through the chat template, the model's call `<tool_call>{"name": "add", "arguments":
{"a": A, "b": B}}</tool_call><eos>`, the tool's answer as the template renders it
(`turns.observation_ids`, not trained), the model's final answer and `<eos>`. Loss on the model's
tokens only, as in RL. With label noise: the call's arguments are the prompt's with probability
`args_fraction` (else random ones of the same length), and the final answer copies the tool's
result with probability `copy_fraction` (else a random number). The model learns the format
fully and the task a little, so GRPO groups see rewards from the first step and must learn to
call the tool with the prompt's numbers and to copy its result. `--task price` (rows
`pear+348=`) makes it two calls in two turns: `price(item)`, then `add(that price, n)`; `--task
code` (rows `348*576=`, `tasks/code_task.py`) a program, `print(348*576)`, for the built-in
`python` tool, whose answer (`exit status 0`, `stdout:` and the number) the model copies.

Measured (tiny llama, 2000 `sum` rows, 600 steps, ~60 s on one thread): with 0.75/0.75 greedy
accuracy 1.0, sampled (T=1) call rate 0.95, argument rate 0.46, accuracy 0.33; with 0.6/0.6
sampled accuracy 0.04; with 0.5/0.5 0.008 (too few rewards for GRPO to start from).

Measured on the distinct prompts (greedy and at temperature 1.0, `num_samples` each) by running
the conversation with the real tool: `tool_warm_start/<greedy|sample>/call_rate` (a parsable
call to `add`), `.../args_rate` (with the prompt's numbers), `.../accuracy` (the final answer
right, the arithmetic reward). Like `warm_start`, this never imports megatron (its own process).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from pathlib import Path
from typing import Any

import torch

from megatron_async_rl.rollout.dataset import DatasetConfig, PromptDataset
from megatron_async_rl.rollout.tool_calls import parse_tool_calls
from megatron_async_rl.rollout.turns import close_turn_ids, observation_ids
from megatron_async_rl.tasks.arithmetic_reward import arithmetic_reward
from megatron_async_rl.tasks.calculator import PRICES, add, price
from megatron_async_rl.tasks.code_task import program, tool_answer
from megatron_async_rl.tasks.warm_start import collate, generate, save_model, torch_threads

logger = logging.getLogger(__name__)


TASKS = ("sum", "price", "code")


def call_text(name: str, arguments: dict) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def _noisy(value: int, rng: random.Random) -> int:
    digits = len(str(value))
    return rng.randint(10 ** (digits - 1), 10**digits - 1)


def plan(prompt: str, task: str, rng: random.Random | None = None, args_fraction: float = 1.0,
         copy_fraction: float = 1.0) -> tuple[list[tuple[str, dict]], str]:  # fmt: skip
    """The calls a conversation makes, in turns, and its final answer, with the warm start's
    label noise (`rng` None: the right ones). `sum`: add(a, b); `price`: price(item), then
    add(its price, n)."""
    noisy = rng is not None

    def right(fraction: float) -> bool:
        return not noisy or rng.random() < fraction

    if task == "code":
        a, b = map(int, prompt.rstrip("=").split("*"))
        if not right(args_fraction):
            a, b = _noisy(a, rng), _noisy(b, rng)
        calls = [("python", {"code": program(a, b)})]
        final = str(a * b) if right(copy_fraction) else str(_noisy(a * b, rng))
        return calls, final
    left, right_text = prompt.rstrip("=").split("+")
    if task == "sum":
        a, b = int(left), int(right_text)
        if not right(args_fraction):
            a, b = _noisy(a, rng), _noisy(b, rng)
        calls = [("add", {"a": a, "b": b})]
        result = add(a, b)
    else:
        item, n = left, int(right_text)
        if not right(args_fraction):
            item = rng.choice(sorted(PRICES))
        first = price(item)
        if not right(args_fraction):
            first, n = _noisy(first, rng), _noisy(n, rng)
        calls = [("price", {"item": item}), ("add", {"a": first, "b": n})]
        result = add(first, n)
    final = str(result) if right(copy_fraction) else str(_noisy(result, rng))
    return calls, final


def _run_call(name: str, arguments: dict) -> str:
    if name == "python" and isinstance(arguments.get("code"), str) and len(arguments) == 1:
        return tool_answer(arguments["code"])
    try:
        return json.dumps({"add": add, "price": price}[name](**arguments))
    except (KeyError, TypeError, ValueError) as err:
        return f"error: {err}"


def conversation(prompt_ids: list[int], calls: list[tuple[str, dict]], final: str,
                 tokenizer: Any) -> tuple[list[int], list[int]]:  # fmt: skip
    """(ids, labels) of one call per turn, each answered by the tool, then `final`: labels on
    the model's tokens only."""
    eos = tokenizer.eos_token_id
    ids, labels = list(prompt_ids), [-100] * len(prompt_ids)
    for name, arguments in calls:
        call = tokenizer.encode(call_text(name, arguments), add_special_tokens=False) + [eos]
        tool = observation_ids(tokenizer, [{"role": "tool",
                                            "content": _run_call(name, arguments)}])  # fmt: skip
        ids += call + tool
        labels += call + [-100] * len(tool)
    answer = tokenizer.encode(final, add_special_tokens=False) + [eos]
    return ids + answer, labels + answer


def evaluate(model: Any, tokenizer: Any, records: list[Any], task: str, num_samples: int = 8,
             seed: int = 0) -> dict[str, float]:  # fmt: skip
    """Call rate (every turn a parsable call of the plan's tool), argument rate (the plan's
    arguments) and accuracy, greedy and at temperature 1.0, running the conversation turn by
    turn with the real tools."""
    eos = tokenizer.eos_token_id
    generator = torch.Generator().manual_seed(seed)
    metrics: dict[str, float] = {}
    model.eval()
    for name, temperature, repeats in (("greedy", 0.0, 1), ("sample", 1.0, num_samples)):
        batch = [r for r in records for _ in range(repeats)]
        plans = [plan(r.prompt_text, task)[0] for r in batch]
        contexts = [list(r.prompt_ids) for r in batch]
        calls_ok, args_ok = [True] * len(batch), [True] * len(batch)
        for turn in range(len(plans[0])):
            outs = generate(model, contexts, 112, eos, temperature, generator)
            for i, out in enumerate(outs):
                parsed = parse_tool_calls(tokenizer.decode(out, skip_special_tokens=True))
                call = parsed.calls[0] if parsed.calls and not parsed.errors else None
                wanted, wanted_args = plans[i][turn]
                calls_ok[i] &= call is not None and call.name == wanted
                args_ok[i] &= calls_ok[i] and call.arguments == wanted_args
                result = _run_call(call.name, call.arguments) if call else "error: no call"
                contexts[i] += out + close_turn_ids(tokenizer, out) + observation_ids(
                    tokenizer, [{"role": "tool", "content": result}])  # fmt: skip
        finals = generate(model, contexts, 8, eos, temperature, generator)
        correct = sum(
            arithmetic_reward(tokenizer.decode(out, skip_special_tokens=True), r.answer, {}) == 1.0
            for r, out in zip(batch, finals)
        )
        metrics[f"tool_warm_start/{name}/call_rate"] = sum(calls_ok) / len(batch)
        metrics[f"tool_warm_start/{name}/args_rate"] = sum(args_ok) / len(batch)
        metrics[f"tool_warm_start/{name}/accuracy"] = correct / len(batch)
    return metrics


def tool_warm_start(model_dir: str | Path, data_path: str | Path, out_dir: str | Path,
                    steps: int = 600, lr: float = 3e-3, batch_size: int = 32, seed: int = 0,
                    args_fraction: float = 0.75, copy_fraction: float = 0.75,
                    num_samples: int = 8, max_eval_prompts: int = 64,
                    num_threads: int | None = 1, task: str = "sum",
                    ) -> dict[str, float]:  # fmt: skip
    """Trains the call format, saves an HF checkpoint to `out_dir`, returns its metrics."""
    if task not in TASKS:
        raise ValueError(f"task = {task!r}: must be one of {', '.join(TASKS)}")
    import transformers

    for name, value in (("args_fraction", args_fraction), ("copy_fraction", copy_fraction)):
        if not 0 <= value <= 1:
            raise ValueError(f"{name} = {value}: must be in [0, 1]")
    if steps < 0 or batch_size < 1 or lr <= 0:
        raise ValueError(f"steps = {steps}, batch_size = {batch_size}, lr = {lr}: need steps "
                         ">= 0, batch_size >= 1, lr > 0")  # fmt: skip
    start = time.perf_counter()
    rng = random.Random(seed)
    with torch_threads(num_threads):
        torch.manual_seed(seed)
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        records = PromptDataset(DatasetConfig(str(data_path), shuffle=False), tokenizer,
                                use_chat_template=True).records  # fmt: skip
        prompt_ids = [r.prompt_ids for r in records]  # through the chat template
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        model.train()
        loss = torch.tensor(float("nan"))
        for _ in range(steps):
            examples = []
            for _ in range(batch_size):
                i = rng.randrange(len(records))
                calls, final = plan(records[i].prompt_text, task, rng, args_fraction,
                                    copy_fraction)  # fmt: skip
                examples.append(conversation(prompt_ids[i], calls, final, tokenizer))
            loss = model(**collate(examples, tokenizer.pad_token_id)).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        distinct = list({r.prompt_text: r for r in records}.values())[:max_eval_prompts]
        metrics = evaluate(model, tokenizer, distinct, task, num_samples, seed)
    metrics["tool_warm_start/train/final_loss"] = float(loss.detach())
    save_model(model, tokenizer, Path(out_dir))
    metrics["tool_warm_start/time_s"] = time.perf_counter() - start
    return metrics


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="HF model directory to start from")
    parser.add_argument("--data", required=True, help="rows (tasks.calculator, tasks.code_task)")
    parser.add_argument("--out", required=True, help="HF directory to write")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--args-fraction", type=float, default=0.75)
    parser.add_argument("--copy-fraction", type=float, default=0.75)
    parser.add_argument("--num-samples", type=int, default=8, help="samples per eval prompt")
    parser.add_argument("--task", choices=TASKS, default="sum")
    args = parser.parse_args(argv)
    metrics = tool_warm_start(args.model, args.data, args.out, args.steps, args.lr,
                              args.batch_size, args.seed, args.args_fraction,
                              args.copy_fraction, args.num_samples, task=args.task)  # fmt: skip
    (Path(args.out) / "warm_start_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    logger.info("tool warm start done: %s", json.dumps(metrics))
    return metrics


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    main()
