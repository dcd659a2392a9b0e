"""The fault tests' request stream lives in `kvd.traffic` (the chaos run uses it too);
here also what those tests judge a daemon's view of its peer by."""

from collections.abc import Mapping

from kvd.traffic import D_TERMINAL, HOST, NOT_OFFERED, P_TERMINAL, Req, Traffic

PEER_GONE = ("peers_forgotten", "peers_given_up", "handshakes_failed", "leases_expired")
"""The counters that grow when a daemon judges its peer gone or too late."""


def judged_gone(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, int]:
    """The `PEER_GONE` counters that grew from `before` to `after` (a daemon's counters)."""
    grown = {c: after.get(c, 0) - before.get(c, 0) for c in PEER_GONE}
    return {c: n for c, n in grown.items() if n}


__all__ = [
    "D_TERMINAL",
    "HOST",
    "NOT_OFFERED",
    "PEER_GONE",
    "P_TERMINAL",
    "Req",
    "Traffic",
    "judged_gone",
]
