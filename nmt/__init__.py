"""nmt: neural machine translation with the Transformer."""

__version__ = "0.1.0"


def __getattr__(name: str):
    """``from nmt import Translator`` without making every command import torch at start-up."""
    if name == "Translator":
        from nmt.generation.translator import Translator

        return Translator
    raise AttributeError(f"module 'nmt' has no attribute {name!r}")
