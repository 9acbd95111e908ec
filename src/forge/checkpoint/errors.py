"""The error raised for a checkpoint that cannot be used."""


class CheckpointError(RuntimeError):
    """A missing, incomplete, corrupt or mismatching checkpoint; the message names the file or key."""


def describe(err: BaseException) -> str:
    """One line per failure of an error from DCP: its CheckpointException prints each rank's whole traceback."""
    failures = getattr(err, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    lines = []
    for rank, (exc, _trace) in sorted(failures.items()):
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        lines.append(f"rank {rank}: {type(exc).__name__}: {text}".rstrip(": "))
    return "; ".join(lines)
