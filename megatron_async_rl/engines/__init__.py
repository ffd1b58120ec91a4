"""Generation engines behind one protocol: the real SGLang engine and a deterministic fake.

`protocol` holds the contract and records; `sglang_engine.SGLangEngine` hosts a real
`sglang.Engine` in a child process (sglang is imported only there); `fake.FakeEngine` is for
unit tests of the code around engines. `cpu_shims/` holds the import shims SGLang needs on CPU.
"""
