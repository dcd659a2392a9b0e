from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvd.core.ids import base_request_id


@pytest.mark.parametrize(
    ("request_id", "expected"),
    [
        ("cmpl-abc-0-1a2b3c4d", "cmpl-abc-0"),
        ("cmpl-abc-0", "cmpl-abc-0"),
        ("req-00000000", "req"),
        ("req-1A2B3C4D", "req-1A2B3C4D"),  # uppercase is not vLLM's suffix
        ("req-1a2b3c4", "req-1a2b3c4"),  # 7 hex digits
        ("req1a2b3c4d5", "req1a2b3c4d5"),  # no dash
        ("req-1a2b3c4g", "req-1a2b3c4g"),  # not hex
        ("-1a2b3c4d", "-1a2b3c4d"),  # nothing left: keep
        ("a-1a2b3c4d-1a2b3c4d", "a-1a2b3c4d"),  # exactly one suffix stripped
        ("", ""),
    ],
)
def test_base_request_id(request_id: str, expected: str) -> None:
    assert base_request_id(request_id) == expected


@given(
    st.text(min_size=1, max_size=30),
    st.text(alphabet="0123456789abcdef", min_size=8, max_size=8),
)
def test_suffix_roundtrip(base: str, suffix: str) -> None:
    assert base_request_id(f"{base}-{suffix}") == base


@given(st.text(max_size=40))
def test_never_longer_and_prefix(request_id: str) -> None:
    out = base_request_id(request_id)
    assert request_id.startswith(out)
    assert len(out) in (len(request_id), len(request_id) - 9)
