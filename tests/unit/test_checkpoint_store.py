"""`checkpoint.store`: atomic publication, the manifest written last, corruption found.

Contracts checked on real files: a published checkpoint verifies; each fault (a truncated
file, a deleted manifest, one flipped byte, a missing file, an unpublished partial directory)
makes `find_resumable` skip it with exactly one warning naming the fault and return the
previous complete one; `prune` keeps the newest `keep_last`; recipe keys that differ are named;
the config refuses bad values naming the key.
"""

from __future__ import annotations

import logging

import pytest

from megatron_async_rl.checkpoint import store
from megatron_async_rl.checkpoint.config import CheckpointConfig
from megatron_async_rl.config.errors import ConfigError


def _save(root, step: int, payload: bytes = b"weights" * 1000):
    staged = store.partial_dir(root, step)
    (staged / "megatron").mkdir(parents=True)
    (staged / "megatron" / "__0_0.distcp").write_bytes(payload + bytes([step]))
    (staged / "rank_00000.pt").write_bytes(b"state" + bytes([step]))
    manifest = store.Manifest(step=step, world_size=2, recipe_hash="h", recipe_keys={"a": 1},
                              files={})  # fmt: skip
    return store.publish(root, step, manifest)


def test_published_checkpoint_verifies_and_lists_every_file(tmp_path):
    path = _save(tmp_path, 4)
    assert path == tmp_path / "step_00000004" and not store.partial_dir(tmp_path, 4).exists()
    manifest, problem = store.verify(path)
    assert problem is None and manifest.step == 4
    assert set(manifest.files) == {"megatron/__0_0.distcp", "rank_00000.pt"}
    assert store.find_resumable(tmp_path)[0] == path


def _truncate(path):
    f = path / "megatron" / "__0_0.distcp"
    f.write_bytes(f.read_bytes()[:100])


def _flip(path):
    f = path / "megatron" / "__0_0.distcp"
    data = bytearray(f.read_bytes())
    data[1234] ^= 0x01
    f.write_bytes(bytes(data))


FAULTS = {
    "truncated": (_truncate, "has 100 bytes"),
    "no_manifest": (lambda p: (p / store.MANIFEST).unlink(), "no manifest.json"),
    "flipped_byte": (_flip, "fails its checksum"),
    "missing_file": (lambda p: (p / "rank_00000.pt").unlink(), "rank_00000.pt is missing"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_bad_checkpoint_is_skipped_with_one_warning(tmp_path, caplog, fault):
    _save(tmp_path, 2)
    newest = _save(tmp_path, 4)
    damage, words = FAULTS[fault]
    damage(newest)
    with caplog.at_level(logging.WARNING, logger="megatron_async_rl.checkpoint.store"):
        path, manifest = store.find_resumable(tmp_path)
    assert path == tmp_path / "step_00000002" and manifest.step == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and words in warnings[0] and "step_00000004" in warnings[0]


def test_a_partial_directory_is_never_resumed_and_is_cleared(tmp_path):
    _save(tmp_path, 2)
    store.partial_dir(tmp_path, 4).mkdir()
    (store.partial_dir(tmp_path, 4) / "rank_00000.pt").write_bytes(b"half")
    assert store.find_resumable(tmp_path)[1].step == 2
    store.remove_partials(tmp_path)
    assert not store.partial_dir(tmp_path, 4).exists()
    assert store.find_resumable(tmp_path / "absent") is None


def test_prune_keeps_the_newest(tmp_path):
    for step in (2, 4, 6, 8):
        _save(tmp_path, step)
    removed = store.prune(tmp_path, keep_last=2)
    assert [p.name for p in removed] == ["step_00000002", "step_00000004"]
    assert [s for s, _ in store.checkpoints(tmp_path)] == [6, 8]


def test_differing_recipe_keys_are_named():
    saved = {"megatron.hidden_size": 64, "algorithm.clip_eps": 0.2, "seed": 1}
    current = {"megatron.hidden_size": 128, "algorithm.clip_eps": 0.2, "seed": 1, "new": 0}
    assert store.differing_keys(saved, current) == ["megatron.hidden_size", "new"]
    assert store.recipe_hash(saved) != store.recipe_hash(current)


def test_an_algorithm_knob_newer_than_the_checkpoint_counts_as_its_default():
    saved = {"algorithm.clip_ratio_low": 0.2, "seed": 1}  # written before the knobs existed
    current = {**saved, "algorithm.policy_loss": "ppo", "algorithm.refill": False}
    assert store.differing_keys(saved, current) == []
    changed = {**current, "algorithm.policy_loss": "gspo"}
    assert store.differing_keys(saved, changed) == ["algorithm.policy_loss"]


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [("every_steps", -1, "must be an integer >= 0"), ("keep_last", 0, "must be an integer >= 1"),
     ("save_on_signal", ["SIGINT"], "must be a list of SIGTERM, SIGUSR1"),
     ("resume", "", "must be auto, never or a checkpoint path"),
     ("async_save", "yes", "must be true or false")],
)  # fmt: skip
def test_bad_checkpoint_config_is_refused(field, value, rule):
    with pytest.raises(ConfigError, match=rule) as info:
        CheckpointConfig(**{field: value})
    assert info.value.key == field


def _keys(**roles):
    from types import SimpleNamespace

    from megatron_async_rl.algorithms.config import GRPOConfig

    cfg = SimpleNamespace(role_megatron_args=roles, algorithm=GRPOConfig(), seed=1)
    return store.compatibility_keys(cfg)


def test_the_optimizer_format_must_match_to_resume(tmp_path):
    """A distributed-optimizer checkpoint does not load into torch's optimizer state
    (--use-torch-fsdp2, or DDP without --use-distributed-optimizer) nor back: dist_checkpointing
    fails on missing keys mid-load. The manifest's keys refuse it first, naming both formats."""
    distributed = _keys(train={"use_distributed_optimizer": True}, logp={})
    fsdp2 = _keys(train={"use_torch_fsdp2": True}, logp={})
    assert distributed["train.optimizer_format"] == "distributed"
    assert fsdp2["train.optimizer_format"] == "torch" and "logp.optimizer_format" not in fsdp2
    assert store.differing_keys(distributed, fsdp2) == ["train.optimizer_format"]
    with pytest.raises(ConfigError, match=r"train.optimizer_format \(saved 'distributed', "
                                          r"now 'torch'\).*hint: resume with the recipe"):
        store.check_same_recipe(tmp_path, distributed, fsdp2)
    critic = _keys(train={}, critic={"use_distributed_optimizer": True})
    assert store.differing_keys(critic, _keys(train={}, critic={})) == ["critic.optimizer_format"]
    older = {k: v for k, v in distributed.items() if not k.endswith("optimizer_format")}
    assert store.differing_keys(older, fsdp2) == []  # a manifest from before: not compared
