"""The real SGLang engine, hosted in a child process a `generate` rank spawns.

`engine.SGLangEngine` is what the rank calls (the pipe protocol, timeouts); `host` runs in the
child and is the only module of the package that imports `sglang`; `handover` makes the tensor
handles a weight update sends; `shm_sweep` removes the shared memory killed engines left behind.
`cpu_shims/` holds the import shims SGLang needs on CPU (put on the child's path, not imported
here).
"""
