"""The host tier's directory (kvd_client.tierdir): the daemon's writer and a client's reader
on one real shared-memory segment."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from kvd_client.shm import SHM_DIR, SharedRegion, unique_name
from kvd_client.tierdir import (
    CLOSED,
    ENTRY,
    HEADER,
    PROBES,
    TierDirReader,
    TierDirWriter,
    digester,
    key_digest,
)


@pytest.fixture
def writer() -> Iterator[TierDirWriter]:
    w = TierDirWriter(unique_name("kvd-test-dir"), 8)
    yield w
    w.close()


def d(i: int) -> bytes:
    return key_digest(b"model", i.to_bytes(4, "big"))


def test_digests_separate_namespaces_and_keys() -> None:
    assert key_digest(b"ab", b"c") != key_digest(b"a", b"bc")
    assert key_digest(b"m", b"k") == key_digest(b"m", b"k")
    assert len(key_digest(b"m", b"k")) == 16
    many = digester(b"model")
    assert [many(i.to_bytes(4, "big")) for i in range(50)] == [d(i) for i in range(50)]


def test_the_table_has_at_least_four_entries_per_pool_slot_a_power_of_two() -> None:
    for pool_slots, want in ((1, 64), (16, 64), (17, 128), (1000, 4096)):
        w = TierDirWriter(unique_name("kvd-test-dir"), pool_slots)
        try:
            assert w.nslots == want
        finally:
            w.close()


def test_published_entries_are_read_back_and_retracted(writer: TierDirWriter) -> None:
    r = TierDirReader(writer.name, 8)
    try:
        assert r.open and r.lookup(d(1)) is None
        assert writer.publish(d(1), 3, 7) and writer.publish(d(2), 4, 1)
        assert r.lookup(d(1)) == (3, 7) and r.lookup(d(2)) == (4, 1)
        assert writer.publish(d(1), 5, 9)  # stored again elsewhere: the old entry goes
        assert r.lookup(d(1)) == (5, 9) and len(writer) == 2
        writer.retract(d(1))
        writer.retract(d(3))  # (never published: nothing happens)
        assert r.lookup(d(1)) is None and r.lookup(d(2)) == (4, 1)
        assert d(2) in writer and d(1) not in writer
    finally:
        r.close()


def test_a_batch_lookup_answers_as_one_lookup_each(writer: TierDirWriter) -> None:
    r = TierDirReader(writer.name, 8)
    try:
        for i in range(6):
            writer.publish(d(i), i, 10 + i)
        writer.retract(d(2))
        writer._q[(HEADER + writer._at[d(4)] * ENTRY) // 8] += 1  # d(4) being rewritten
        probe = [d(i) for i in range(8)]
        assert r.lookup_many(probe) == [r.lookup(x) for x in probe]
        assert r.lookup_many(probe) == [(0, 10), (1, 11), None, (3, 13), None, (5, 15)] + [None] * 2
        writer._q[1] = CLOSED
        assert r.lookup_many(probe) == [None] * 8
    finally:
        r.close()


def test_an_entry_being_rewritten_is_not_read(writer: TierDirWriter) -> None:
    r = TierDirReader(writer.name, 8)
    try:
        writer.publish(d(1), 2, 3)
        e = writer._at[d(1)]
        seq = (HEADER + e * ENTRY) // 8
        writer._q[seq] += 1  # odd: the daemon is in the middle of rewriting it
        assert r.lookup(d(1)) is None
        writer._q[seq] += 1
        assert r.lookup(d(1)) == (2, 3)
    finally:
        r.close()


def test_a_block_with_no_free_probe_is_not_published(writer: TierDirWriter) -> None:
    r = TierDirReader(writer.name, 8)
    try:
        first = int.from_bytes(d(1)[:8], "little") & (writer.nslots - 1)
        # other digests that fill every probe of d(1)
        fillers, i = [], 100
        while len(fillers) < PROBES:
            x = d(i)
            if int.from_bytes(x[:8], "little") & (writer.nslots - 1) == (first + len(fillers)) & (
                writer.nslots - 1
            ):
                fillers.append(x)
            i += 1
        for f in fillers:
            assert writer.publish(f, 0, 1)
        assert not writer.publish(d(1), 1, 1)
        assert writer.unpublished == 1 and r.lookup(d(1)) is None
        writer.retract(fillers[2])
        assert writer.publish(d(1), 1, 1) and r.lookup(d(1)) == (1, 1)
    finally:
        r.close()


def test_a_closed_directory_answers_nothing() -> None:
    w = TierDirWriter(unique_name("kvd-test-dir"), 8)
    r = TierDirReader(w.name, 8)
    try:
        w.publish(d(1), 2, 3)
        w._q[1] = CLOSED  # (as `close` does, before it unlinks)
        assert not r.open and r.lookup(d(1)) is None
    finally:
        w.close()
        r.close()
    assert not os.path.exists(os.path.join(SHM_DIR, w.name))


def test_a_reader_refuses_what_is_not_this_pools_directory(writer: TierDirWriter) -> None:
    with pytest.raises(ValueError, match="not the tier directory"):
        TierDirReader(writer.name, 9)  # another pool's
    with SharedRegion(unique_name("kvd-test-dir"), 4096) as junk:
        junk.buf[:8] = b"NOTADIR!"
        with pytest.raises(ValueError, match="not the tier directory"):
            TierDirReader(junk.name, 8)
    with (
        SharedRegion(unique_name("kvd-test-dir"), 16) as tiny,
        pytest.raises(ValueError, match="not the tier directory"),
    ):
        TierDirReader(tiny.name, 8)


def test_a_slot_outside_the_pool_is_never_handed_out(writer: TierDirWriter) -> None:
    with pytest.raises(ValueError, match="outside a pool"):
        writer.publish(d(1), 8, 1)
    r = TierDirReader(writer.name, 8)
    try:
        writer.publish(d(1), 7, 1)
        e = writer._at[d(1)]
        off = HEADER + e * ENTRY + 8 + 16
        writer._buf[off : off + 8] = (1 << 40).to_bytes(8, "little")  # a wild slot
        assert r.lookup(d(1)) is None
    finally:
        r.close()
