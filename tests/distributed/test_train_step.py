"""One train step gives the same new weights whatever the train role's layout.

Contract: `MegatronRole.train_step` with a loss normalised over the whole step (global token
count) produces, after one Adam step from the same HF checkpoint on the same batch, weights that
agree within 1e-6 across TP=1, TP=2, PP=2 and DP=2 (each DP rank trains on half the batch), and
that differ from the starting weights. This pins the gradient-accumulation and data-parallel
scaling in `train_step`. Nothing is faked: real megatron-core on gloo ranks.
"""

import pytest

from tests.harness.ranks import spawn
from tests.harness.train_steps import train_step_worker

LAYOUTS = {
    "tp1": (1, {}),
    "tp2": (2, {"tensor_model_parallel_size": 2}),
    "pp2": (2, {"pipeline_model_parallel_size": 2}),
    "dp2": (2, {}),
}


@pytest.fixture(scope="module")
def tiny_path(tiny_model):
    return str(tiny_model("llama"))


def test_layouts_agree_after_one_step(tiny_path, tmp_path):
    from megatron_async_rl.models.hf_checkpoint import load_hf_state_dict

    start = load_hf_state_dict(tiny_path)
    weights = {}
    for name, (world, parallel) in LAYOUTS.items():
        (tmp_path / name).mkdir()
        results = spawn(train_step_worker, world, tmp_path / name, tiny_path, parallel)
        weights[name] = next(r["weights"] for r in results if r["weights"] is not None)
        grad_norms = {round(r["metrics"]["actor/grad_norm"], 5) for r in results}
        assert len(grad_norms) == 1 and grad_norms.pop() > 0, (name, grad_norms)
    reference = weights["tp1"]
    assert any(not reference[k].equal(start[k]) for k in start)
    for name, got in weights.items():
        for key, tensor in reference.items():
            diff = (got[key] - tensor).abs().max().item()
            assert diff <= 1e-6, f"{name} {key}: max abs diff {diff} vs tp1"
