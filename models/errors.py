"""Errors raised when a checkpoint or its tokenizer cannot be used."""


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt or unsupported; the message names the fix."""
