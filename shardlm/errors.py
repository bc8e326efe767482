"""Errors users see. A ``UsageError`` is bad input: the CLI prints its one-line message
and exits 2. A ``RankFailure`` is a rank that died or a collective that timed out: the
run ends with its message and exit 1, never a hang."""


class UsageError(ValueError):
    """Bad input: the message names the value, says why, and suggests a valid one."""


class ClosedError(UsageError, AttributeError):
    """A closed object was used. An AttributeError too, so that probes (``hasattr``, ``copy``) of
    a closed object find nothing rather than fail."""


class RankFailure(RuntimeError):
    """A rank died, raised, or stopped answering; every rank of the run is stopped."""


class PeerLost(RankFailure):
    """Raised in a rank whose peer died, gave up or timed out: the message names the peer; the
    peer's own report, where it sends one, says why."""
