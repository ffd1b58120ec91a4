"""Running model-written code where it cannot reach the network, the host's files, other
processes or the trainer: bubblewrap (`bwrap`, the Debian package `bubblewrap`) plus resource
limits. `config.SandboxConfig` (the limits), `command.bwrap_argv` (pure: the command line),
`run.run_sandboxed` (a program in, a `SandboxResult` out), `tools` (the built-in tools `python`
and `bash`)."""
