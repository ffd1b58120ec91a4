"""Generation engines behind one protocol: the real SGLang engine and a deterministic fake.

`protocol` holds the contract and records; `config` the recipe's `engine:` and `faults:`
sections; `sglang/` hosts a real `sglang.Engine` in a child process (`sglang.engine.SGLangEngine`;
sglang is imported only in `sglang.host`, with the CPU import shims in `sglang/cpu_shims/`);
`recovery/` restarts a dead engine and carries its requests on; `fake.FakeEngine` is for unit
tests of the code around engines.
"""
