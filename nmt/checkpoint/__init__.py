"""Checkpoints, in one package: the file format (format.py), the file names and their order
(names.py), and averaging (averaging.py). Training keeps only its policy of which names to write,
prune and resume from (nmt/training/checkpoints.py)."""

from nmt.checkpoint.format import (Vocabularies, check_compatible, describe, load_checkpoint, make_checkpoint,
                                   model_from_checkpoint, model_only, model_state, save_checkpoint)

__all__ = ["Vocabularies", "check_compatible", "describe", "load_checkpoint", "make_checkpoint",
           "model_from_checkpoint", "model_only", "model_state", "save_checkpoint"]
