"""nmt: neural machine translation with the Transformer."""

from nmt.tuning import tune_for_decoding
from nmt.version import __version__

__all__ = ["Translator", "tune_for_decoding", "__version__"]


def __getattr__(name: str):
    """``from nmt import Translator`` without making every command import torch at start-up."""
    if name == "Translator":
        from nmt.generation.translator import Translator

        return Translator
    raise AttributeError(f"module 'nmt' has no attribute {name!r}")
