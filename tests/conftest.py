"""Test-suite wiring: skip `gpu` tests without CUDA; keep CPU ranks from oversubscribing; the
session's tiny models, task and shared synchronous run."""

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_collection_modifyitems(config, items):
    import torch

    unmarked = [item.nodeid for item in items
                if item.nodeid.startswith("tests/e2e/") and "e2e" not in item.keywords]  # fmt: skip
    if unmarked:  # so that `-m "not e2e"` runs no entry-point run
        raise pytest.UsageError(f"tests under tests/e2e without the e2e marker: {unmarked}")
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    """Stop the forkserver the distributed harness starts its ranks from
    (`tests/harness/ranks.py`) and then this process's resource tracker, which unlinks
    the semaphores ranks left in /dev/shm. Left alone, both outlived pytest. (Their `_stop`
    methods are multiprocessing's own, private, used by CPython's tests; absent: nothing.)

    Each stop is bounded: `_stop` waits for its process to exit, which it does only once every
    process that inherited its pipe has closed it; a child still alive would hang the session
    before pytest's summary (seen on a CUDA node after the in-process GPU tests). Past the bound
    the stacks are dumped and the session ends anyway."""
    import faulthandler
    import sys
    import threading
    from multiprocessing import forkserver, resource_tracker

    for name, owner in (("forkserver", forkserver._forkserver),
                        ("resource tracker", resource_tracker._resource_tracker)):  # fmt: skip
        stop = getattr(owner, "_stop", None)
        if stop is None:
            continue
        worker = threading.Thread(target=_best_effort, args=(stop,), daemon=True)
        worker.start()
        worker.join(STOP_TIMEOUT_S)
        if worker.is_alive():
            print(f"\nconftest: the {name} did not stop in {STOP_TIMEOUT_S} s; stacks:",
                  file=sys.stderr)  # fmt: skip
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)


STOP_TIMEOUT_S = 20


def _best_effort(stop) -> None:
    try:
        stop()
    except Exception:  # noqa: BLE001, S110 - best effort at exit
        pass


# One seed for every family: the tests want random norms and biases (see `models.tiny`), not
# distinct seeds, and one directory per (family, overrides) serves the whole session.
TINY_SEED = 0


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """`tiny_model(family, **overrides)` -> the directory of a tiny HF model (`write_tiny_model`,
    seed `TINY_SEED`), written once per session for each (family, overrides). Read-only: a test
    that writes next to a checkpoint uses its own `tmp_path`."""
    from megatron_async_rl.models.tiny import write_tiny_model

    written = {}

    def get(family: str, **overrides):
        key = (family, tuple(sorted(overrides.items())))
        if key not in written:
            out = tmp_path_factory.mktemp(f"tiny-{family}") / family
            written[key] = write_tiny_model(out, family, seed=TINY_SEED, **overrides)
        return written[key]

    return get


# What the e2e and cluster tests share: one task (tiny model, a dataset with bad rows, a
# validation set) and one run of the synchronous recipe on one host, which `test_grpo_job` reads
# for the job's contracts and the others compare with (the asynchronous loop at N = 0, the same
# run on two hosts).
@pytest.fixture(scope="session")
def task(tmp_path_factory):
    """`tests.harness.recipes.Task`: the tiny model, the training data, the validation set."""
    from megatron_async_rl.models.tiny import write_tiny_model
    from megatron_async_rl.tasks.arithmetic import write_arithmetic_dataset
    from tests.harness.recipes import Task

    root = tmp_path_factory.mktemp("task")
    model = write_tiny_model(root / "model", "llama", seed=0)
    data = write_arithmetic_dataset(root / "train.jsonl", num_rows=200, seed=0)
    with open(data, "a") as f:
        f.write('{"prompt": "1+1="}\n')  # missing answer
        f.write("{not json\n")  # malformed JSON, line 202
        f.write('{"prompt": "", "answer": "0"}\n')  # empty prompt
    val = write_arithmetic_dataset(root / "val.jsonl", num_rows=12, seed=1)
    return Task(model, data, val)


@pytest.fixture(scope="session")
def sync_run(task, tmp_path_factory):
    """`tests.harness.recipes.Run` of the synchronous recipe (`SYNC_SETS`) on the session's task."""
    from tests.harness.recipes import SYNC_SETS, run_recipe

    run_dir = tmp_path_factory.mktemp("sync") / "run"
    return run_recipe(task, run_dir, *SYNC_SETS, f"validation.data.path={task.val}")
