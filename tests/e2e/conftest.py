"""What the e2e tests share: one task (tiny model, a dataset with bad rows, a validation set)
and one run of the synchronous recipe, which `test_grpo_job` reads for the job's contracts and
`test_async_job` compares the asynchronous loop at `generate_ahead_steps: 0` with."""

from __future__ import annotations

import pytest

from tests.e2e.recipe_runs import SYNC_SETS, Run, Task, run_recipe


@pytest.fixture(scope="session")
def task(tmp_path_factory) -> Task:
    from megatron_async_rl.models.tiny import write_tiny_model
    from megatron_async_rl.rollout.arithmetic import write_arithmetic_dataset

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
def sync_run(task, tmp_path_factory) -> Run:
    run_dir = tmp_path_factory.mktemp("sync") / "run"
    return run_recipe(task, run_dir, 29631, *SYNC_SETS, f"validation.data.path={task.val}")
