"""The error raised for a checkpoint that cannot be used."""


class CheckpointError(RuntimeError):
    """A missing, incomplete, corrupt or mismatching checkpoint; the message names the file or key."""
