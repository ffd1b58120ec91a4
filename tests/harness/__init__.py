"""What the tests share, one module per concern; no test module imports another
(`tests/unit/test_test_tree.py` checks it).

- `ranks`, `rank_preload`: spawn gloo ranks on CPU from a warm forkserver (`spawn`).
- `ports`: a port the OS says is free (`free_port`); no test writes a port number.
- `clocks`: `FakeClock`, advanced by hand.
- `recipes`: a recipe run through `launch/torchrun.sh` and what it leaves (e2e, cluster).
- `roles`: a role's Megatron arguments from a HF checkpoint, roles over one window of ranks.
- `parity`: the HF-parity families, tolerance and tokens.
- `train_steps`, `checkpoints`, `minibatch`, `mtp`, `heads`, `routing`, `weight_sync`: rank
  workers and references shared by tests/distributed and their GPU twins in tests/gpu.
- `environments`, `hf_configs`, `megatron_lm_examples`: fakes and data shared by unit tests.
"""
