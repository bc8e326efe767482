"""Errors users see. A ``UsageError`` is bad input: the CLI prints its one-line message
and exits 2. A ``RankFailure`` is a rank that died or a collective that timed out: the
run ends with its message and exit 1, never a hang."""


class UsageError(ValueError):
    """Bad input: the message names the value, says why, and suggests a valid one."""


class RankFailure(RuntimeError):
    """A rank died, raised, or stopped answering; every rank of the run is stopped."""
