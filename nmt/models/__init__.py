"""Models and the one registry every command reads (registry.py). Importing the package registers
its architectures, so that ``get_arch("transformer_base")`` works from any module that imports the
registry."""

import nmt.models.transformer  # noqa: F401  (registers the transformer and its archs)
