"""The asynchronous pipeline's scheduling logic: stage states and their transition tables,
stage machines, bounded queues between stages, the staleness bound and the `scheduler:` recipe
section. Pure Python (no torch, no process groups); the async job drives it."""
