"""Exports of nmt checkpoints to other inference engines."""
