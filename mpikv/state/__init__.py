"""Checkpoints of a store (the files' contents) and background saves."""
