"""The recipe: every section's config in one `RunConfig`, read from YAML and resolved.

`schema` (the aggregate dataclasses: `RunConfig`, `ResolvedConfig`, the roles and their groups),
`tree` (YAML file -> tree, `--set`, tree -> dataclasses, `config.resolved.yaml`) and `load`
(`resolve`, `build_config`: a tree and the Megatron flags into a `ResolvedConfig`). It sits above
every package whose `config` section it gathers (and, lazily, the layout, `models.hf_config` and
`models.upcycle`) and below the jobs that read it.
"""
