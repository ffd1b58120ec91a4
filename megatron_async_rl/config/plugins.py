"""Objects a recipe names as `module:attribute` (tools, environments): imported, or one error.

Owned here: `import_named(spec, key, shape)`. A spec that is not `module:attribute`, or that
does not import, is a ConfigError naming the recipe key, the value and why (`shape` says what
was expected, e.g. "module:function").
"""

from __future__ import annotations

import importlib
from typing import Any

from megatron_async_rl.config.errors import ConfigError


def import_named(spec: Any, key: str, shape: str) -> Any:
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ConfigError(key, spec, f"must be {shape}")
    module_name, attr = spec.split(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(key, spec, f"cannot import it: {err}") from None
