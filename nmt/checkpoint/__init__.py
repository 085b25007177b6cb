"""Checkpoints, in one package: the file format (format.py), the file names and their order
(names.py), and averaging (averaging.py). Training keeps only its policy of which names to write,
prune and resume from (nmt/training/checkpoints.py). Import from the modules: this file imports
nothing, so that reading checkpoint names or options does not import torch."""
