"""Code run in child processes with a time bound, for rewards and tools.

`worker_pool.WorkerPool`: a pool of spawned workers for many calls at once (the `math` reward's
Math-Verify graders, tool calls); a call past its bound replaces the whole pool. `isolated.
IsolatedReward`: one child process that builds a reward and answers one call at a time (the
recipe's `reward.call_timeout_s`); a call past its bound kills that child. Imports nothing of
the package.
"""
