"""Sphinx configuration of the user documentation (`sphinx-build -W -b html docs OUT`).

Sphinx with myst-parser: megatron-core's and verl's documentation are Sphinx sites, and MyST
keeps every page Markdown, so the pages read the same on GitHub as in the built site and text
moves between README.md and docs/ unchanged. Two reference pages are generated at build time by
the local extension `_ext/recipe_reference.py`, so they cannot drift from the code: every recipe
key from the config dataclasses, and every Megatron-LM flag with its verdict here. The build
imports only the pure config modules (no autodoc, no torch) and takes seconds; only when the
Megatron flag table's disk cache is cold does it import megatron-core once to fill it (see
`_ext/recipe_reference.py`). `tests/unit/test_docs.py` runs it with warnings as errors.
"""

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))
sys.path.insert(0, str(DOCS.parent))

project = "megatron_async_rl"
author = "megatron_async_rl contributors"
extensions = ["myst_parser", "recipe_reference"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_ext", "README.md"]
myst_heading_anchors = 4
myst_enable_extensions = ["deflist"]
html_theme = "alabaster"
html_title = "megatron_async_rl"
html_static_path: list[str] = []
suppress_warnings: list[str] = []
nitpicky = False
