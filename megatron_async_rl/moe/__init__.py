"""Mixture-of-experts routing across the engine/trainer boundary: the engines' routed experts
per token (`routing`), replayed in the Megatron roles' forward passes (`replay`), configured by
the recipe's `moe:` section (`config`)."""
