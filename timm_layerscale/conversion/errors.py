class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the problem and the fix in one line."""
