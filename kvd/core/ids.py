"""Request-id normalisation.

vLLM appends a per-engine random suffix (``-`` + exactly 8 lowercase hex digits) to
request ids, so the prefill and decode engines know the same request under two ids
that share a *base id*. This module strips that suffix. Pure functions, no state.
"""

from __future__ import annotations

from typing import Final

_SUFFIX_LEN: Final = 9  # "-" + 8 hex digits
_HEX: Final = frozenset("0123456789abcdef")


def base_request_id(request_id: str) -> str:
    """Return ``request_id`` without one trailing ``-xxxxxxxx`` (lowercase hex) suffix.

    Ids without such a suffix come back unchanged. Only one suffix is stripped, and an
    id that is nothing but a suffix is left alone (its base would be empty).
    """
    if len(request_id) <= _SUFFIX_LEN or request_id[-_SUFFIX_LEN] != "-":
        return request_id
    tail = request_id[-8:]
    if not _HEX.issuperset(tail):
        return request_id
    return request_id[:-_SUFFIX_LEN]
