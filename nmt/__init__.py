"""nmt: neural machine translation with the Transformer."""

__version__ = "0.1.0"
