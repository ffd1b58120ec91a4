"""Megatron flags: what each one is, what it does here, how it is read, and the rules across them.

`table` (the flags we build from: types, defaults, ranges, derived from megatron-core's config
dataclasses), `core_kwargs` (megatron-core constructor kwargs from a resolved dict), `inventory`
(Megatron-LM's flags per release, `megatron_lm_flags/*.json`, and one verdict per dest) with
`verdicts` (its tables), `parse` (the flags after `--` and the recipe's `megatron:` sections) and
`rules` (cross-field rules on one role's args). A leaf: it imports `config.errors` and
`config.checks` only, and megatron-core inside functions.
"""
