"""This project against Hugging Face TRL's `GRPOTrainer` on the same task, model and settings.

    .venv/bin/python benchmarks/vs_trl.py [--sizes quickstart,h384,h768] [--out runs/bench-vs-trl]
                                          [--trl-site ~/.cache/megatron_async_rl/trl-site]
                                          [--rounds N]

TRL is an optional extra for this script only, never a dependency of the package; install it
beside the environment, without touching its packages:

    pip install --no-deps --target ~/.cache/megatron_async_rl/trl-site trl==1.16.0 accelerate

The task is the quick start's (single-digit addition, `tasks/arithmetic`), with its reward
(`arithmetic_reward`), 16 prompts x 8 samples a step, one optimizer step per RL step (4
micro-batches of 32), KL coefficient 0, clip 0.2 / 0.28, advantages normalised by the group's
std, token-mean loss, Adam (beta2 0.99, no weight decay) at a constant lr 1e-3, clip-grad 1.0,
temperature 1, float32. Three sizes, one after another in this one sitting:

    quickstart   the quick start's warm-started model (hidden 64, 2 layers), 4 new tokens
    h384         a Llama of hidden 384, 6 layers (untrained), 48 new tokens
    h768         a Llama of hidden 768, 12 layers (untrained), 48 new tokens

At each size the timed runs force every response to exactly the new-token budget on both
sides (ours: `rollout.ignore_eos`; TRL: `min_new_tokens` = `max_completion_length`), and the
script checks the lengths each side logged. Ours runs the quick start's own loop at the first
size (`yaml_configs/tiny-grpo-cpu.yaml`, synchronous) and both loops at the larger ones
(synchronous and one step ahead, `tiny-grpo-async-cpu.yaml`), with only the train role placed
(`--placement`): the old log-probs are then the train forward's (synchronous) or the engine's
(one step ahead), and no reference model exists (`algorithm.old_logprobs`). TRL runs in one
process with both cores (`torch.set_num_threads(2)`); ours is 2 ranks of one core each
(Megatron | one SGLang engine). Medians are over steps 1+ (step 0 warms up).

Rounds: a shared machine's speed drifts by tens of percent from one minute to the next, so a
size's two sides run in rounds, TRL then ours and ours then TRL in turn (`--rounds`; by default
5 at the quick start, whose runs take seconds, and 1 at the larger sizes), each round's ratio
from its own two sides, and a size's figure is the median of its rounds' ratios (each printed).

Then the learning curves: the quick start as it ships (its own placement, natural lengths)
and TRL, `--curve-steps` steps each, reward per step and its 10-step mean side by side in
`<out>/curves.png` and `<out>/curves.jsonl`.

At h768, one step ahead also runs with `--baseline-placement` (default `[train, logp, ref]`:
every pass the recipes ran before `algorithm.old_logprobs`), for the learn side's cut.
`--threads-per-rank 2` gives each of our ranks both cores' threads (whether a rank whose
window-mate waits should use its core).

Last line: `RESULT vs_trl_quickstart=<r> vs_trl_h384=<r> vs_trl_h768=<r>
learn_side_h768_s=<s> ...`, each r = TRL's seconds per step / ours (the quick start's own
loop at the first size, one step ahead at the larger two; the median over rounds, and the
`<size>_*_s` seconds the medians of the rounds'), and the learn side = the Megatron
rank's busy seconds per step one step ahead at h768 (`learn_side_h768_cut`: 1 - that / the
baseline's).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.learn_passes import (  # noqa: E402
    RECIPES,
    arith_data,
    learn_busy,
    llama_model,
    median_after_first,
)
from tests.harness.recipes import launch_command, launch_env  # noqa: E402

# name: (hidden, layers, new tokens, timed steps, rounds); hidden None: the quick start's model
SIZES = {
    "quickstart": (None, None, 4, 30, 5),
    "h384": (384, 6, 48, 5, 1),
    "h768": (768, 12, 48, 4, 1),
}
DEFAULT_TRL_SITE = Path.home() / ".cache" / "megatron_async_rl" / "trl-site"
UNMATCHED = """Settings that cannot be matched:
  - processes: TRL is one process using both cores for each phase in turn; ours is two ranks of
    one core each (Megatron roles | SGLang engine), which overlap only one step ahead.
  - generation: TRL pads the batch and calls transformers' `generate` (KV cache, SDPA); ours is
    SGLang's scheduler (continuous batching, torch-native attention on CPU, radix cache).
  - forced lengths: TRL's `min_new_tokens` sets the EOS logit to -inf; ours ignores EOS (SGLang's
    `ignore_eos`: an EOS may be sampled inside a response, which then goes on). Same lengths,
    so the same work; the sampled tokens differ.
  - samples: each side draws with its own generator; the same seed gives different samples.
  - loss: TRL's `dapo` divides by the tokens of the whole accumulated batch; ours is token-mean
    (`algorithm.loss_agg_mode`). TRL's model is transformers' Llama; ours is Megatron-core's GPT
    (`transformer_impl: local`), the same weights.
  - weight sync: TRL generates with the model it trains; ours copies the weights to the engine
    after every step (inside our step time)."""


# -- TRL's side (a subprocess: TRL and accelerate on the path, both cores) ----------------------


def trl_worker(spec: dict) -> None:
    """Run TRL's GRPOTrainer as `spec` says; one JSON line per step to `spec['out']`."""
    import torch

    torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from megatron_async_rl.tasks.arithmetic_reward import arithmetic_reward

    rows = [json.loads(line) for line in Path(spec["data"]).read_text().splitlines()]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    tokens = spec["tokens"]

    def reward(prompts, completions, answer, **_):
        return [arithmetic_reward(c, a, {}) for c, a in zip(completions, answer, strict=True)]

    config = GRPOConfig(
        output_dir=spec["run_dir"], max_steps=spec["steps"], seed=spec["seed"], use_cpu=True,
        per_device_train_batch_size=32, gradient_accumulation_steps=4, steps_per_generation=4,
        num_generations=8, max_completion_length=tokens, temperature=1.0, top_p=1.0, top_k=0,
        generation_kwargs={"min_new_tokens": tokens} if spec["forced"] else None,
        learning_rate=1e-3, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.99, adam_epsilon=1e-8, max_grad_norm=1.0,
        beta=0.0, epsilon=0.2, epsilon_high=0.28, loss_type="dapo", scale_rewards="group",
        num_iterations=1, logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, bf16=False, dataloader_num_workers=0,
        gradient_checkpointing=False,  # TRL's default is True; ours keeps activations
    )  # fmt: skip
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer)  # fmt: skip
    spent = {"generate": 0.0, "score": 0.0}

    def timed(name, method):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start

        return wrapper

    trainer._generate_single_turn = timed("generate", trainer._generate_single_turn)
    trainer._generate_and_score_completions = timed(
        "score", trainer._generate_and_score_completions)
    rows: list[dict] = []

    class Steps(TrainerCallback):
        """Each optimizer step's seconds (end to end) and stages; then TRL's logged reward and
        completion lengths of that step (`on_log` follows `on_step_end`)."""

        last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            rows.append({"step": state.global_step - 1, "step_s": now - Steps.last,
                         "threads": spec["threads"],
                         "generate_s": spent["generate"],
                         "reward_and_advantages_s": spent["score"] - spent["generate"],
                         "train_s": now - Steps.last - spent["score"]})  # fmt: skip
            spent.update(generate=0.0, score=0.0)
            Steps.last = now

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = logs or {}
            if rows and "reward" in logs:
                rows[-1].update(reward=logs["reward"],
                                length_mean=logs.get("completions/mean_length"),
                                length_min=logs.get("completions/min_length"),
                                length_max=logs.get("completions/max_length"))  # fmt: skip

    trainer.add_callback(Steps())
    trainer.train()
    Path(spec["out"]).write_text("".join(json.dumps(r) + "\n" for r in rows))


def run_trl(name, model, data, out, steps, tokens, forced, trl_site, threads, seed=1234):
    run_dir = out / f"trl-{name}"
    shutil.rmtree(run_dir, ignore_errors=True)  # nothing of an earlier sitting
    run_dir.mkdir(parents=True)
    spec = {"model": str(model), "data": str(data), "steps": steps, "tokens": tokens,
            "forced": forced, "seed": seed, "threads": threads,
            "run_dir": str(run_dir), "out": str(run_dir / "steps.jsonl")}  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(trl_site), str(REPO),
                                           os.environ.get("PYTHONPATH", "")]))  # fmt: skip
    done = subprocess.run([sys.executable, __file__, "--trl-worker", json.dumps(spec)], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=7200)  # fmt: skip
    if done.returncode != 0:
        sys.exit(f"TRL {name}: exit {done.returncode}\n{done.stderr[-4000:]}")
    return [json.loads(x) for x in Path(spec["out"]).read_text().splitlines()]


# -- our side -----------------------------------------------------------------------------------


def run_ours(name, loop, model, data, out, steps, tokens, forced, placement, threads=1,
             seed=1234, label=None, extra_sets=()):
    """Our side as `vs_trl` times it; `extra_sets`: more `--set` items, applied last."""
    run_dir = out / f"ours-{name}-{label or loop}"
    # A run directory keeps its checkpoints, and a launch into it resumes from the newest: into
    # an earlier sitting's, a run of as many steps would run none and leave that sitting's rows.
    shutil.rmtree(run_dir, ignore_errors=True)
    sets = [f"model.hf_path={model}", f"data.path={data}", f"trainer.num_steps={steps}",
            "scheduler.validation_every=0", "checkpoint.every_steps=0", f"seed={seed}",
            f"rollout.max_new_tokens={tokens}", f"megatron.seq_length={tokens + 16}"]  # fmt: skip
    if forced:
        sets.append("rollout.ignore_eos=true")
    if placement:
        sets.append(f"roles.groups[0].roles={placement}")
    sets.extend(extra_sets)
    env = dict(launch_env(), OMP_NUM_THREADS=str(threads))
    done = subprocess.run(launch_command(RECIPES[loop], run_dir, *sets), env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=7200)  # fmt: skip
    if done.returncode != 0:
        sys.exit(f"ours {name} {loop}: exit {done.returncode}\n{done.stderr[-4000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{"step": r["step"], "step_s": r["timing/step_s"], "learn_busy_s": learn_busy(r),
             "generate_s": r.get("timing/generate_s"), "train_s": r.get("timing/train_s"),
             "weight_sync_s": r.get("timing/weight_sync_s"), "reward": r.get("reward/mean"),
             "length_mean": r.get("response_len/mean"),
             "length_min": r.get("response_len/min"),
             "length_max": r.get("response_len/max")} for r in rows]  # fmt: skip


# -- the comparison -----------------------------------------------------------------------------


def one_round(name, model, data, steps, tokens, loops, args, trl_threads, trl_first: bool):
    """Both sides at one size, in the order given: (TRL's fastest rows, ours by loop)."""

    def trl_side():
        return fastest([run_trl(f"{name}-t{threads}", model, data, args.out, steps, tokens, True,
                                args.trl_site, threads) for threads in trl_threads])  # fmt: skip

    def our_side():
        return {loop: run_ours(name, loop, model, data, args.out, steps, tokens, True,
                               args.placement, args.threads_per_rank)
                for loop in loops}  # fmt: skip

    if trl_first:
        trl = trl_side()
        return trl, our_side()
    ours = our_side()
    return trl_side(), ours


def fastest(runs: list[list[dict]]) -> list[dict]:
    """The run of the lowest median step time; each run's figure printed."""
    for rows in runs:
        print(f"  (TRL with {rows[0]['threads']} thread(s): {median(rows, 'step_s'):.3f} s/step)")
    return min(runs, key=lambda rows: median(rows, "step_s"))


def median(rows, key):
    """The median of `key` over steps 1+ (step 0 warms up)."""
    return median_after_first(rows, lambda r: r.get(key))


def lengths(rows) -> tuple[float, float]:
    lows = [r["length_min"] for r in rows if r.get("length_min") is not None]
    highs = [r["length_max"] for r in rows if r.get("length_max") is not None]
    return (min(lows) if lows else float("nan"), max(highs) if highs else float("nan"))


def show(side: str, rows: list[dict]) -> str:
    stages = [k for k in ("generate_s", "reward_and_advantages_s", "train_s", "weight_sync_s",
                          "learn_busy_s") if any(r.get(k) is not None for r in rows)]  # fmt: skip
    low, high = lengths(rows)
    return (f"  {side:18s} {median(rows, 'step_s'):8.3f} s/step   "
            + "  ".join(f"{k[:-2]} {median(rows, k):.3f}" for k in stages)
            + f"   response length {low:g}..{high:g}")  # fmt: skip


def curves_png(path: Path, ours: list[dict], trl: list[dict]) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no PNG (the curves are in curves.jsonl)"
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, rows in (("megatron_async_rl (quick start)", ours), ("TRL GRPOTrainer", trl)):
        steps = [r["step"] for r in rows]
        ax.plot(steps, [r["reward"] for r in rows], alpha=0.3)
        ax.plot(steps, moving_mean([r["reward"] for r in rows]), label=label,
                color=ax.lines[-1].get_color())  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("reward/mean (10-step mean bold)")
    ax.set_title("Quick start task, same model and settings")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return f"curves: {path}"


def moving_mean(values, window: int = 10) -> list[float]:
    return [statistics.fmean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def first_at(values, level: float) -> int | None:
    return next((i for i, v in enumerate(moving_mean(values)) if v >= level), None)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="quickstart,h384,h768")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench-vs-trl")
    parser.add_argument("--trl-site", type=Path, default=DEFAULT_TRL_SITE)
    parser.add_argument("--placement", default="[train]",
                        help="roles of the Megatron group in the timed runs ('' keeps the "
                        "recipe's)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps at every size")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds of both sides at every size (default: 5 at the quick "
                        "start, 1 at the larger sizes); a size's ratio is their median")
    parser.add_argument("--curve-steps", type=int, default=60,
                        help="steps of the learning-curve runs (0: none)")
    parser.add_argument("--trl-threads", default=f"1,{os.cpu_count() or 1}",
                        help="TRL's torch threads, a run each; TRL's figure is the fastest "
                        "(on 2 cores one thread wins at the smallest size, two at the larger)")
    parser.add_argument("--baseline-placement", default="[train, logp, ref]",
                        help="at h768, one step ahead is also run with these roles (every pass "
                        "the recipes ran before `algorithm.old_logprobs`; '' skips it): the "
                        "learn side's cut")
    parser.add_argument("--threads-per-rank", type=int, default=1,
                        help="our ranks' torch threads (OMP_NUM_THREADS; the launcher's CPU "
                        "default is 1: one core a rank)")
    parser.add_argument("--trl-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trl_worker:
        trl_worker(json.loads(args.trl_worker))
        return 0
    if not (args.trl_site / "trl").is_dir():
        sys.exit(f"--trl-site {args.trl_site}: no trl there; install it with\n  pip install "
                 f"--no-deps --target {args.trl_site} trl==1.16.0 accelerate")
    sizes = [s for s in args.sizes.split(",") if s]
    unknown = sorted(set(sizes) - set(SIZES))
    if unknown:
        sys.exit(f"--sizes {args.sizes}: unknown {unknown}; choose from {sorted(SIZES)}")
    trl_threads = sorted({int(t) for t in args.trl_threads.split(",")})
    args.out.mkdir(parents=True, exist_ok=True)
    quick_model, quick_data = quickstart_inputs()
    print(UNMATCHED)
    result, checks = {}, []
    for name in sizes:
        hidden, layers, tokens, steps, rounds = SIZES[name]
        steps, rounds = args.steps or steps, args.rounds or rounds
        model = quick_model if hidden is None else llama_model(args.out, hidden, layers)
        data = quick_data if hidden is None else arith_data(args.out)
        loops = ["sync"] if name == "quickstart" else ["sync", "ahead"]
        mine = "sync" if name == "quickstart" else "ahead"
        what = "quick start model" if hidden is None else f"hidden {hidden} x {layers}"
        print(f"\n{name}: {what}, {tokens} new tokens forced, {steps} steps, {rounds} "
              "round(s); medians over steps 1+:")
        figures = []  # per round: (ratio, TRL s/step, ours s/step of each loop)
        for index in range(rounds):
            # TRL first, then ours first: a drift of the machine's speed favours neither side
            trl, ours = one_round(name, model, data, steps, tokens, loops, args, trl_threads,
                                  trl_first=index % 2 == 0)  # fmt: skip
            label = f"round {index + 1}" if rounds > 1 else ""
            print(show(f"TRL {label}".strip(), trl))
            for loop, rows in ours.items():
                print(show(f"ours {loop} {label}".strip(), rows))
            for side, rows in [("TRL", trl)] + [(f"ours {k}", v) for k, v in ours.items()]:
                low, high = lengths(rows)
                checks.append(low == high == tokens)
                if not checks[-1]:
                    print(f"  ! {side}: response lengths {low:g}..{high:g}, not all {tokens}")
            steps_s = {loop: median(rows, "step_s") for loop, rows in ours.items()}
            figures.append((median(trl, "step_s") / steps_s[mine], median(trl, "step_s"),
                            steps_s))  # fmt: skip
        ratios = [ratio for ratio, _, _ in figures]
        if rounds > 1:
            print(f"  TRL / ours {mine} by round: " + ", ".join(f"{r:.3f}" for r in ratios)
                  + f"; median {statistics.median(ratios):.3f}")  # fmt: skip
        result[f"vs_trl_{name}"] = statistics.median(ratios)
        for loop in loops:
            result[f"{name}_{loop}_s"] = statistics.median(f[2][loop] for f in figures)
        result[f"{name}_trl_s"] = statistics.median(f[1] for f in figures)
        if name == "h768":
            # the last round's, and the baseline run once after it
            result["learn_side_h768_s"] = median(ours["ahead"], "learn_busy_s")
            if args.baseline_placement:
                base = run_ours(name, "ahead", model, data, args.out, steps, tokens, True,
                                args.baseline_placement, args.threads_per_rank,
                                label="ahead-baseline")  # fmt: skip
                print(show(f"ours ahead {args.baseline_placement}", base))
                result["learn_side_h768_baseline_s"] = median(base, "learn_busy_s")
                result["learn_side_h768_cut"] = 1 - (result["learn_side_h768_s"]
                                                     / result["learn_side_h768_baseline_s"])
    if args.curve_steps:
        ours = run_ours("curve", "sync", quick_model, quick_data, args.out, args.curve_steps,
                        SIZES["quickstart"][2], False, "")  # fmt: skip
        trl = run_trl("curve", quick_model, quick_data, args.out, args.curve_steps,
                      SIZES["quickstart"][2], False, args.trl_site, trl_threads[0])  # fmt: skip
        with open(args.out / "curves.jsonl", "w") as f:
            for side, rows in (("ours", ours), ("trl", trl)):
                for r in rows:
                    f.write(json.dumps({"side": side, **r}) + "\n")
        print(f"\nlearning curves, the quick start as it ships, {args.curve_steps} steps "
              "(natural lengths):")
        for side, rows in (("ours", ours), ("TRL", trl)):
            rewards = [r["reward"] for r in rows]
            print(f"  {side:5s} reward/mean 10-step mean at the end "
                  f"{moving_mean(rewards)[-1]:.3f}, first >= 0.6 at step {first_at(rewards, 0.6)}"
                  f", mean response length {median(rows, 'length_mean'):.2f}")
        print(curves_png(args.out / "curves.png", ours, trl))
    forced_ok = all(checks)
    print("RESULT " + " ".join(f"{k}={v:.3f}" for k, v in result.items())
          + f" lengths_equal={str(forced_ok).lower()}")
    return 0 if forced_ok else 1


def quickstart_inputs() -> tuple[Path, Path]:
    """The quick start's warm-started model and data, made as `scripts/quickstart.sh` makes them
    (kept under runs/ and reused)."""
    model, data = REPO / "runs" / "tiny-llama-warm", REPO / "runs" / "arith" / "train.jsonl"
    steps = [
        (REPO / "runs" / "tiny-llama" / "config.json",
         ["megatron_async_rl.models.tiny", "--family", "llama", "--out", "runs/tiny-llama",
          "--seed", "0"]),
        (data, ["megatron_async_rl.tasks.arithmetic", "--out", str(data), "--num-rows", "2000",
                "--seed", "0"]),
        (model / "config.json",
         ["megatron_async_rl.tasks.warm_start", "--model", "runs/tiny-llama", "--data", str(data),
          "--out", str(model), "--seed", "0"]),
    ]  # fmt: skip
    for made, command in steps:
        if not made.exists():
            subprocess.run([sys.executable, "-m", *command], check=True, cwd=REPO)
    return model, data


if __name__ == "__main__":
    sys.exit(main())
