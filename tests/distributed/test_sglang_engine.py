"""The real SGLang engine (CPU, fp32, tiny local Llama) behind `SGLangEngine`.

Contract checked: greedy generation returns tokens, log-probs and per-token weight versions;
those log-probs match an independent `transformers` forward pass over the same sequence
(mean abs diff <= 1e-3); a weight update through begin/update/end is bit-exact as read back by
`get_weights_by_name` and stamps its version on later tokens; an in-place or retracting pause
around an update switches the version mid-sequence; timeouts, misuse, a killed scheduler and a
failed start are reported as errors naming the rank, and the test process survives; without
SGLang's tokenizer and detokenizer (the default) it gives the tokens, log-probs and finish
reasons an engine with them gives (greedy, with and without a stop token); shutdown
leaves no process and no file in /dev/shm behind (SGLang never removes its load-snapshot
file). A TP=2 engine reads back the full tensors it was sent, generates like the TP=1 engine
with the same weights, and reports its killed scheduler (one engine for the three contracts);
its SGLang processes are spawned (as on a GPU), the others' forked from their host (the CPU
default).
A tiny DeepSeek-V3 (multi-latent attention) matches `transformers` the same way on every CPU:
the engine runs `torch_native` attention whatever SGLang's AMX probe answers (that probe is
monkeypatched, in a separate interpreter, to emulate an AMX CPU), and the shims' two SGLang
patches are shown fixing defects the unpatched SGLang has (its modules asked directly, the
attention batch faked). Otherwise nothing is faked; the models are made locally (the session's
`tiny_model` fixture), so nothing is downloaded. One TP=1 engine serves most tests (module
fixture, ~20 s to start on 2 cores); the TP=2, DeepSeek and failed-start tests start their own.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from megatron_async_rl.engines.protocol import (
    INITIAL_VERSION,
    EngineDiedError,
    EngineTimeoutError,
    GenerateRequest,
    SamplingParams,
)
from megatron_async_rl.engines.sglang.engine import HostLaunch, SGLangEngine
from megatron_async_rl.engines.sglang.host import CPU_ATTENTION_BACKEND, CPU_SHIMS_DIR
from megatron_async_rl.engines.sglang.shm_sweep import load_snapshot_files
from megatron_async_rl.roles.generate import EngineHeadStart
from tests.harness.engine import (
    CHECKED_WEIGHTS,
    PROMPTS,
    Served,
    engine_config,
    greedy,
    hf_logprob_diff,
    hf_model,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("sglang") is None,
        reason="sglang is not installed; run scripts/install_sglang_cpu.sh",
    ),
]


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> Path:
    # Room for long generations: the pause test must still be decoding when it pauses.
    return tiny_model("llama", max_position_embeddings=1024)


@pytest.fixture(scope="module")
def served(model_dir):
    from safetensors.torch import load_file

    # Started as an engine host rank starts its first engine: launched early (the host starts
    # SGLang while the rank builds its world and roles), then adopted by the engine.
    config = engine_config(model_dir)
    head_start = EngineHeadStart(HostLaunch(config, rank_in_role=0, global_rank=5))
    launch = head_start.take(config)
    assert launch is not None
    engine = SGLangEngine(config, rank_in_role=0, global_rank=5, launch=launch)
    head_start.close()  # adopted: nothing to kill
    assert engine.host_pid == launch.proc.pid and _alive(engine.host_pid)
    assert engine.start_method == "fork"  # on CPU, SGLang's processes forked from its host
    print(f"\nengine startup: {engine.startup_s:.1f} s")
    yield Served(engine, model_dir, load_file(model_dir / "model.safetensors"))
    engine.shutdown()


def _update(served: Served, version: str, flush_cache: bool = True) -> float:
    """Perturb every tensor, send it all through begin/update/end; returns seconds taken."""
    new = {name: t + 0.01 * torch.randn_like(t) for name, t in served.state.items()}
    start = time.perf_counter()
    served.engine.begin_weight_update()
    served.engine.update_weights(list(new.items()), version, flush_cache=flush_cache)
    served.engine.end_weight_update()
    served.state, served.version = new, version
    return time.perf_counter() - start


def test_generate_greedy_with_logprobs_matches_transformers(served):
    requests = greedy(24, "greedy")
    start = time.perf_counter()
    results = served.engine.generate(requests)
    print(f"generate 3 x 24 tokens: {time.perf_counter() - start:.2f} s")
    assert [r.rid for r in results] == [r.rid for r in requests]
    for result in results:
        assert 1 <= len(result.output_ids) <= 24
        assert result.finish_reason in ("length", "stop")
        assert result.token_versions == [served.version] * len(result.output_ids)
        assert all(lp <= 0 for lp in result.output_logprobs)
    again = served.engine.generate(requests)  # greedy is deterministic (a prefix-cache hit)
    assert [r.output_ids for r in again] == [r.output_ids for r in results]
    for first, second in zip(results, again):
        torch.testing.assert_close(first.output_logprobs, second.output_logprobs, atol=1e-5, rtol=0)
    diff = hf_logprob_diff(served, results, requests)
    print(f"log-prob mean abs diff vs transformers: {diff:.2e}")
    assert diff <= 1e-3


def test_weight_update_is_bit_exact_and_versioned(served):
    seconds = _update(served, "v1")
    print(f"weight update (all {len(served.state)} tensors): {seconds:.3f} s")
    assert served.engine.weight_version() == "v1"
    for name in CHECKED_WEIGHTS:
        sent, got = served.state[name], served.engine.get_weights_by_name(name)
        # SGLang pads the vocab dimension (embedding, LM head) to a multiple of 64.
        assert torch.equal(got[: sent.shape[0]], sent), name
        assert not got[sent.shape[0] :].any(), name
    requests = greedy(16, "after-v1")
    results = served.engine.generate(requests)
    assert all(r.token_versions == ["v1"] * len(r.output_ids) for r in results)
    diff = hf_logprob_diff(served, results, requests)
    print(f"log-prob mean abs diff vs transformers after update: {diff:.2e}")
    assert diff <= 1e-3


def test_weight_update_from_one_shared_buffer_is_bit_exact(served):
    """Views of one shared buffer (a weight-sync message) cross as one flat span: SGLang's
    `flattened_bucket` load format rebuilds them in the scheduler."""
    from megatron_async_rl.engines.sglang import handover
    from megatron_async_rl.weight_sync import buffers

    specs = [(name, tuple(t.shape), t.dtype) for name, t in served.state.items()]
    views, _ = buffers.shared_arena(specs)
    for name, tensor in served.state.items():
        views[name].copy_(tensor - 0.02 * torch.randn_like(tensor))
    named = list(views.items())
    assert handover.flatten(named) is not None and handover.flatten(named).tensor.is_shared()
    served.engine.begin_weight_update()
    served.engine.update_weights(named[:3], "flat-partial", flush_cache=False)
    served.engine.update_weights(named[3:], "flat")
    served.engine.end_weight_update()
    served.state, served.version = {n: t.clone() for n, t in named}, "flat"
    assert served.engine.weight_version() == "flat"
    for name in CHECKED_WEIGHTS:
        sent, got = served.state[name], served.engine.get_weights_by_name(name)
        assert torch.equal(got[: sent.shape[0]], sent), name
        assert not got[sent.shape[0] :].any(), name
    results = served.engine.generate(greedy(8, "after-flat"))
    assert all(r.token_versions == ["flat"] * len(r.output_ids) for r in results)


def test_misuse_is_rejected(served):
    with pytest.raises(RuntimeError, match="between begin_weight_update"):
        served.engine.update_weights([("model.norm.weight", served.state["model.norm.weight"])], 9)
    with pytest.raises(ValueError, match="pause mode = 'sideways'"):
        served.engine.pause("sideways")
    with pytest.raises(KeyError, match="no weight 'no.such.weight'"):
        served.engine.get_weights_by_name("no.such.weight")


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_update_resume_switches_version_mid_sequence(served, mode):
    requests = greedy(600, f"pause-{mode}")
    box = {}
    worker = threading.Thread(target=lambda: box.update(out=served.engine.generate(requests)))
    worker.start()
    for version in (f"{mode}-1", f"{mode}-2"):
        time.sleep(0.3)
        served.engine.pause(mode)
        if mode == "in_place":
            with pytest.raises(ValueError, match="paused in_place"):
                served.engine.update_weights([], version)
        seconds = _update(served, version, flush_cache=(mode != "in_place"))
        print(f"pause({mode}) + update: {seconds:.3f} s")
        served.engine.resume()
    worker.join(timeout=240)
    assert "out" in box, "generate did not return"
    order = [INITIAL_VERSION, "v1", "flat", "in_place-1", "in_place-2", "retract-1", "retract-2"]
    switched = 0
    for result in box["out"]:
        seen = list(dict.fromkeys(result.token_versions))  # distinct, in order
        assert seen == sorted(seen, key=order.index), seen
        switched += len(seen) > 1
        print(mode, result.rid, [(v, result.token_versions.count(v)) for v in seen])
    if switched == 0:
        pytest.skip("generation finished before the first pause; nothing switched mid-sequence")
    served.engine.flush_cache()  # in_place kept KV computed by older weights


def _assert_read_back_as_sent(got: torch.Tensor, sent: torch.Tensor, name: str) -> None:
    # The vocab rows of embedding and LM head come back padded with zeros.
    assert got.shape[1:] == sent.shape[1:], (name, got.shape, sent.shape)
    assert torch.equal(got[: sent.shape[0]], sent), name
    assert not got[sent.shape[0] :].any(), name


def test_tp2_engine_reads_back_full_tensors_generates_like_tp1_and_reports_its_death(
    served, monkeypatch
):
    """TP=2 with SGLANG_CPU_OMP_THREADS_BIND unset: the host binds the two TP ranks itself. Full
    HF tensors sent through begin/update/end (SGLang shards them) read back whole, bit for bit
    (assembled from every TP rank's parameters), and a read-back after an update sees the new
    weights; greedy generation equals the module's TP=1 engine loaded with the same weights
    (same tokens, log-probs within 1e-4). Then its scheduler is SIGKILLed: the next call raises
    EngineDiedError naming the rank, the process and the exit code, and shutdown leaves no
    process and no file in /dev/shm. Its SGLang processes are spawned, as on a GPU, where the
    module's engine forked them: the same tokens either way."""
    from safetensors.torch import load_file

    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    start_state = load_file(served.model_dir / "model.safetensors")  # what a new engine serves
    generator = torch.Generator().manual_seed(0)
    new_state = {
        name: t + 0.01 * torch.randn(t.shape, generator=generator)
        for name, t in start_state.items()
    }
    requests = greedy(16, "tp")
    config = engine_config(served.model_dir, tp_size=2, process_start="spawn")
    engine = SGLangEngine(config, rank_in_role=1, global_rank=7)
    pids = [engine.host_pid, *engine.engine_child_pids]
    try:
        assert engine.start_method == "spawn"
        print(f"\nTP=2 engine startup: {engine.startup_s:.1f} s")
        q_name = "model.layers.0.self_attn.q_proj.weight"
        assert torch.equal(engine.get_weights_by_name(q_name), start_state[q_name])
        engine.begin_weight_update()
        engine.update_weights(list(new_state.items()), "tp-v1")
        engine.end_weight_update()
        tp2 = engine.generate(requests)
        for name, sent in new_state.items():  # every tensor, not a sample
            _assert_read_back_as_sent(engine.get_weights_by_name(name), sent, name)
        with pytest.raises(KeyError, match="no weight 'no.such.weight' on every TP rank"):
            engine.get_weights_by_name("no.such.weight")

        scheduler = next(
            pid for pid in engine.engine_child_pids if "scheduler" in psutil.Process(pid).name()
        )
        os.kill(scheduler, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(
            EngineDiedError,
            match=rf"rank in role 1, global rank 7.*scheduler_0 \(pid {scheduler}\) exited "
            r"with code -9.*exit code 3",
        ):
            engine.generate(greedy(8, "dead"))
        print(f"engine death reported after {time.monotonic() - start:.2f} s")
        assert not engine.health()
        with pytest.raises(EngineDiedError, match="cannot call weight_version"):
            engine.weight_version()
    finally:
        engine.shutdown()
    assert not any(_alive(pid) for pid in pids)
    assert not any(os.path.exists(f) for f in engine._engine_files)
    assert all(r.token_versions == ["tp-v1"] * len(r.output_ids) for r in tp2)

    served.engine.begin_weight_update()
    served.engine.update_weights(list(new_state.items()), "tp-v1")
    served.engine.end_weight_update()
    served.state, served.version = new_state, "tp-v1"
    worst = 0.0
    for one, two in zip(served.engine.generate(requests), tp2, strict=True):
        assert one.output_ids == two.output_ids, (one.rid, one.output_ids, two.output_ids)
        diff = torch.tensor(one.output_logprobs) - torch.tensor(two.output_logprobs)
        worst = max(worst, diff.abs().max().item())
    print(f"TP=1 vs TP=2 greedy log-probs: max abs diff {worst:.2e}")
    assert worst <= 1e-4


def test_generate_timeout_is_reported_and_engine_recovers(served):
    config = served.engine.config
    served.engine.config = dataclasses.replace(config, generate_timeout_s=0.2)
    try:
        with pytest.raises(EngineTimeoutError, match="did not answer generate within 0.2 s"):
            served.engine.generate(greedy(200, "timeout"))
    finally:
        served.engine.config = config
    assert served.engine.health()
    assert len(served.engine.generate(greedy(4, "recovered"))[0].output_ids) >= 1


def test_multiturn_on_the_real_engine(served):
    """`rollout.multiturn` on the real engine (the twin of `tests/unit/test_multiturn.py`):
    every turn continues from the trajectory's token ids, so a `transformers` forward pass
    over each whole trajectory gives the engine's log-prob for every model token (within
    1e-3, environment tokens in between), and the model tokens carry the engine's version."""
    from megatron_async_rl.models.tiny import build_tokenizer
    from megatron_async_rl.rollout.environment import EpisodeSample
    from megatron_async_rl.rollout.multiturn import MultiTurnLimits, generate_trajectories
    from tests.harness.environments import ToolTurns

    _update(served, "v7")  # a policy-version label (earlier tests here use free-form ones)
    tok = build_tokenizer()
    prompts = ["1+2=", "3+4="]
    prompt_ids = [tok.encode(f"<|user|>{p}<eos><|assistant|>", add_special_tokens=False)
                  for p in prompts]  # fmt: skip
    sampling = SamplingParams(max_new_tokens=6, temperature=0.0)
    trajs, episodes, counts = generate_trajectories(
        served.engine, tok, ToolTurns, [EpisodeSample(p) for p in prompts], prompt_ids,
        sampling, MultiTurnLimits(max_turns=4),
    )  # fmt: skip
    assert [e.finish_reason for e in episodes] == ["done", "done"] and counts["turns"] == 6
    model = hf_model(served)
    diffs = []
    with torch.no_grad():
        for traj in trajs:
            ids = torch.tensor([traj.context()])
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
            start = len(traj.prompt_ids)
            for offset, (token, mask) in enumerate(zip(traj.ids, traj.loss_mask, strict=True)):
                if mask:
                    ref = logp[start + offset - 1, token].item()
                    diffs.append(abs(ref - traj.logprobs[offset]))
            assert {v for v, m in zip(traj.versions, traj.loss_mask, strict=True) if m} == {7}
            assert 0 in traj.loss_mask and traj.turns == 3
    print(f"multi-turn log-prob mean abs diff vs transformers: {sum(diffs) / len(diffs):.2e}")
    assert sum(diffs) / len(diffs) <= 1e-3


def test_one_token_requests_and_requests_at_the_engines_limits(served):
    """The engine reports the limits SGLang puts on a request (a multi-turn trajectory stays
    within them); a turn with one token left, and one at exactly those limits, still has a
    log-prob per token."""
    engine = served.engine
    assert engine.context_tokens == 1024  # the module's model: max_position_embeddings
    assert engine.max_input_tokens < engine.context_tokens
    longest = [1] + [10 + i % 50 for i in range(engine.max_input_tokens - 2)]
    left = engine.context_tokens - len(longest)
    requests = [
        GenerateRequest(PROMPTS[0], SamplingParams(max_new_tokens=1, temperature=1.0), "one"),
        GenerateRequest(longest, SamplingParams(max_new_tokens=left, temperature=1.0), "full"),
    ]
    for result in engine.generate(requests):
        assert 1 <= len(result.output_ids) == len(result.output_logprobs), result
    with pytest.raises(ValueError, match="exceeds the maximum allowed length"):
        engine.generate([GenerateRequest(longest + [11], SamplingParams(max_new_tokens=1),
                                         "too-long")])  # fmt: skip


def test_ignore_eos_on_the_real_engine(served):
    """`SamplingParams.ignore_eos` (`rollout.ignore_eos`): sampled responses that would stop at
    EOS run to `max_new_tokens`, EOS tokens and all (the fake engine's twin:
    `tests/unit/test_ignore_eos.py`)."""
    eos = 2  # `<eos>` of the tiny tokenizer (models/tiny.SPECIAL_TOKENS)

    def requests(ignore: bool) -> list[GenerateRequest]:
        return [GenerateRequest(PROMPTS[i % len(PROMPTS)], SamplingParams(
            max_new_tokens=24, temperature=1.0, seed=100 + i, ignore_eos=ignore,
            stop_token_ids=() if ignore else (eos,)), f"eos-{ignore}-{i}") for i in range(32)]

    natural = served.engine.generate(requests(False))
    stopped = [r for r in natural if r.finish_reason == "stop"]
    print(f"stopped at EOS without ignore_eos: {len(stopped)} of 32, lengths "
          f"{sorted(len(r.output_ids) for r in stopped)}, last tokens "
          f"{sorted({r.output_ids[-1] for r in stopped})}")
    assert stopped and all(r.output_ids[-1] == eos for r in stopped)
    assert any(len(r.output_ids) < 24 for r in stopped)
    forced = served.engine.generate(requests(True))
    assert all(len(r.output_ids) == len(r.output_logprobs) == 24 for r in forced)
    assert {r.finish_reason for r in forced} == {"length"}
    assert any(eos in r.output_ids[:-1] for r in forced)


def test_no_tokenizer_in_the_engine_changes_no_token(served):
    """The engine runs without SGLang's tokenizer and detokenizer (`skip_tokenizer_init`, the
    default of `host.engine_kwargs`): the same greedy requests, streamed as an engine with
    restarts streams them, then with a stop token that ends some of them early, give the same
    token ids, log-probs and finish reasons as an engine with SGLang's tokenizer on, at the
    same weights. (Greedy: SGLang draws samples from its process's generator, whose state
    depends on what the engine sampled before, unless its deterministic inference is on.)"""
    assert served.engine.config.server_args.get("skip_tokenizer_init") is None  # the default's
    config = engine_config(served.model_dir, progress_every_tokens=8,
                           server_args={"skip_tokenizer_init": False})  # fmt: skip
    with_tokenizer = SGLangEngine(config, rank_in_role=0, global_rank=6)
    engines = (served.engine, with_tokenizer)
    try:
        _update(served, "v-tokens")  # the same new weights into both, both caches flushed
        with_tokenizer.begin_weight_update()
        with_tokenizer.update_weights(list(served.state.items()), served.version)
        with_tokenizer.end_weight_update()
        ours, theirs = (engine.generate(greedy(16, "tok")) for engine in engines)
        stop = ours[0].output_ids[len(ours[0].output_ids) // 2]  # ends that one half-way
        requests = [GenerateRequest(r.input_ids, dataclasses.replace(
            r.sampling, stop_token_ids=(stop,)), f"tok-stop-{i}")
            for i, r in enumerate(greedy(16, "tok"))]  # fmt: skip
        stopped = [engine.generate(requests) for engine in engines]
    finally:
        with_tokenizer.shutdown()
    assert "stop" in {r.finish_reason for r in stopped[0]}
    for mine, other in ((ours, theirs), tuple(stopped)):
        assert [(r.output_ids, r.finish_reason, r.token_versions) for r in mine] == [
            (r.output_ids, r.finish_reason, r.token_versions) for r in other]
        assert [r.output_logprobs for r in mine] == [r.output_logprobs for r in other]


def test_shutdown_leaves_no_processes(served):
    pids = [served.engine.host_pid, *served.engine.engine_child_pids]
    files = served.engine._engine_files  # SGLang's load-snapshot file in /dev/shm
    assert files and all(os.path.exists(f) for f in files)
    served.engine.shutdown()
    served.engine.shutdown()  # idempotent
    assert not any(_alive(pid) for pid in pids)
    assert not any(os.path.exists(f) for f in files), "the engine left files in /dev/shm"
    assert not served.engine.health()
    with pytest.raises(RuntimeError, match="was shut down; cannot call generate"):
        served.engine.generate(greedy(4, "after-shutdown"))


def test_a_launch_nobody_adopts_is_killed_with_what_it_started(model_dir):
    """A run that stops before its early-launched engine is adopted (a checkpoint of another
    recipe, a bad data file) kills the launch: the host and any SGLang process it started, and
    the load-snapshot file in /dev/shm its scheduler made before the engine served."""
    launch = HostLaunch(engine_config(model_dir), rank_in_role=0, global_rank=5)
    host = psutil.Process(launch.proc.pid)
    deadline = time.monotonic() + 120
    # Not any child: the host's imports run `ldconfig -p`, which may be gone a moment later.
    while not (sglang := _sglang_processes(host)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sglang, "the host started no SGLang process within 120 s"
    # and its scheduler made its load-snapshot file, which SGLang never removes
    while not (files := load_snapshot_files(host.pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert files, "the scheduler made no load-snapshot file within 120 s"
    started = [host.pid, *(p.pid for p in host.children(recursive=True))]
    EngineHeadStart(launch).close()
    assert not launch.proc.is_alive()
    assert not any(_alive(pid) for pid in started), started
    assert not any(os.path.exists(f) for f in files), files


def test_failed_start_raises_engine_died_error(tmp_path):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(EngineDiedError, match=r"failed to start \(role generate, rank in role 2"):
        SGLangEngine(engine_config(tmp_path / "no-model"), rank_in_role=2, global_rank=9)
    new = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert all("resource_tracker" in " ".join(p.cmdline()) for p in new), new


def _sglang_processes(host: psutil.Process) -> list[int]:
    """The pids of `host`'s descendants that SGLang named (`sglang::scheduler`, ...)."""
    found = []
    for child in host.children(recursive=True):
        try:
            if child.name().startswith("sglang::"):
                found.append(child.pid)
        except psutil.NoSuchProcess:
            pass
    return found


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# Run in a fresh interpreter with the CPU engine's environment (what the engine host sets up),
# so nothing of SGLang's import-time state reaches this process.
def _probe(script: str, *args: str, patched: bool = True) -> dict:
    """Run `script` (printing one JSON line last) under the CPU engine's environment; with
    `patched=False` the shims are importable but `cpu_shims/sitecustomize.py` does not run."""
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(CPU_SHIMS_DIR) if patched else None, env.get("PYTHONPATH")) if p
    )
    prelude = f"import sys; sys.path.insert(0, {str(CPU_SHIMS_DIR)!r})\n"
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", prelude + script, *args],
                         env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# SGLang decides a CPU's default attention backend from `cpu_has_amx_support()`: AMX tiles
# (`is_amx_tile_supported`) and sgl-kernel's CPU build (`_is_intel_amx_backend_available`).
_BACKEND_PROBE = """
import json, sys
from unittest import mock
import sglang.srt.utils.common as common
from sglang.srt.server_args import ServerArgs
from megatron_async_rl.engines.config import SGLangEngineConfig
from megatron_async_rl.engines.sglang.host import engine_kwargs

model = sys.argv[1]
out = {}
for tiles, kernels in [(True, True), (True, False), (False, False)]:
    with mock.patch.object(common, "is_amx_tile_supported", tiles), mock.patch.object(
        common, "_is_intel_amx_backend_available", lambda: kernels
    ):
        for who, kwargs in [("sglang", {"model_path": model, "device": "cpu"}),
                            ("ours", engine_kwargs(SGLangEngineConfig(model_path=model)))]:
            args = ServerArgs(**kwargs)
            args.resolve_once()
            out[f"{who}, amx={tiles}, kernels={kernels}"] = (
                args.resolved_dict()["attention_backend"])
print(json.dumps(out))
"""


def test_cpu_attention_backend_is_the_engines_choice_not_the_cpus(tiny_model):
    """Whatever the CPU, our CPU engine runs `torch_native` attention: with SGLang's AMX probe
    emulated, its own default would be `intel_amx` on an AMX CPU with sgl-kernel's CPU build,
    `torch_native` otherwise; ours resolves to `torch_native` in every case."""
    model_dir = tiny_model("deepseek_v3", max_position_embeddings=1024)
    resolved = _probe(_BACKEND_PROBE, str(model_dir))
    assert resolved == {
        "sglang, amx=True, kernels=True": "intel_amx",
        "ours, amx=True, kernels=True": CPU_ATTENTION_BACKEND,
        "sglang, amx=True, kernels=False": "torch_native",
        "ours, amx=True, kernels=False": CPU_ATTENTION_BACKEND,
        "sglang, amx=False, kernels=False": "torch_native",
        "ours, amx=False, kernels=False": CPU_ATTENTION_BACKEND,
    }
    assert CPU_ATTENTION_BACKEND == "torch_native"


# What `cpu_shims/sitecustomize.py` changes, asked of SGLang's own modules.
_PATCH_PROBE = """
import json
from types import SimpleNamespace
from unittest import mock
import torch
import sglang.srt.mem_cache.pool_host.common as pool_host
import sglang.srt.models.deepseek_common.attention_backend_handler as handlers

out = {}
try:
    pool_host._cuda_host_register(torch.zeros(16))
    out["pin_host_buffer"] = "ok"
except Exception as exc:
    out["pin_host_buffer"] = str(exc)
handler = handlers.AttentionBackendRegistry.get_handler("torch_native")
prefill = SimpleNamespace(is_extend_without_speculative=lambda: True, is_decode=lambda: False)
batch = SimpleNamespace(forward_mode=prefill, extend_prefix_lens_cpu=[0, 0])  # no cached prefix
exec_config = SimpleNamespace(deterministic=SimpleNamespace(enable_deterministic_inference=False))
with mock.patch.object(handlers, "get_exec", lambda: exec_config):
    out["mla_handler"] = handler.__name__
    out["mla_prefill_form"] = handler(SimpleNamespace(), batch).name
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
runner = SimpleNamespace(device="cpu", req_to_token_pool=None, token_to_kv_pool=None)
out["torch_native_backend"] = type(ATTENTION_BACKENDS["torch_native"](runner)).__name__
print(json.dumps(out))
"""


def test_cpu_shims_patches_show_the_upstream_defects_and_fix_them():
    """On the versions `cpu_shims/sitecustomize.py` patches: upstream, pinning a host buffer
    fails without CUDA, and SGLang's MLA models run an uncached prefill in the "MHA" form under
    `torch_native` (the Triton backend's answer; that backend then reads per-head keys from a
    latent KV cache: a shape error); patched, pinning does nothing and the form is the absorbed
    "MLA" one, which the torch-native backend serves (the DeepSeek-V3 test below); and
    `torch_native` builds the batched backend (`batched_attention.py`)."""
    import importlib.metadata
    import importlib.util

    spec = importlib.util.spec_from_file_location("shims_site", CPU_SHIMS_DIR / "sitecustomize.py")
    site = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(site)  # only defines the hook here: sglang's modules are not loaded
    if importlib.metadata.version("sglang") not in site.PATCHED_VERSIONS:
        pytest.skip(f"sglang {importlib.metadata.version('sglang')} is not patched")
    upstream = _probe(_PATCH_PROBE, patched=False)
    assert "not compiled with CUDA" in upstream["pin_host_buffer"], upstream
    assert upstream["mla_handler"] == "handle_attention_triton"
    assert upstream["mla_prefill_form"] == "MHA"
    assert upstream["torch_native_backend"] == "TorchNativeAttnBackend"  # a loop per request
    patched = _probe(_PATCH_PROBE)
    assert patched == {"pin_host_buffer": "ok", "mla_handler": "handle_attention_torch_native",
                       "mla_prefill_form": "MLA",
                       "torch_native_backend": "BatchedTorchNativeAttnBackend"}  # fmt: skip


def test_deepseek_v3_family_on_the_real_engine(tiny_model):
    """The DeepSeek-V3 family (multi-latent attention, a dense then a MoE layer with a shared
    expert, sigmoid group routing with an expert bias, YaRN) as SGLang serves it on CPU, with
    torch-native attention whatever the CPU: log-probs match `transformers`, and a weight update
    in the names the trainer's name map sends is applied."""
    from safetensors.torch import load_file

    model_dir = tiny_model("deepseek_v3", max_position_embeddings=1024)
    engine = SGLangEngine(engine_config(model_dir), rank_in_role=0, global_rank=5)
    try:
        assert engine.attention_backend == CPU_ATTENTION_BACKEND
        served = Served(engine, model_dir, load_file(model_dir / "model.safetensors"))
        requests = greedy(16, "ds")
        diff = hf_logprob_diff(served, engine.generate(requests), requests)
        print(f"\ndeepseek_v3 log-prob mean abs diff vs transformers: {diff:.2e}")
        assert diff <= 1e-3
        _update(served, "v1")
        requests = greedy(16, "ds-v1")
        results = engine.generate(requests)
        assert all(r.token_versions == ["v1"] * len(r.output_ids) for r in results)
        diff = hf_logprob_diff(served, results, requests)
        print(f"deepseek_v3 after a weight update: {diff:.2e}")
        assert diff <= 1e-3
    finally:
        engine.shutdown()
