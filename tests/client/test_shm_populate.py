"""Mappings populated for write: every page present, nothing changed (real shared memory)."""

from __future__ import annotations

import mmap
import os
import resource

from kvd_client.shm import SharedRegion, map_for_write, populate_for_write, staging_name

MB = 1 << 20


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_populated_mapping_keeps_every_byte_and_writes_without_faults() -> None:
    with SharedRegion(staging_name("test-populate"), 16 * MB) as r:
        pattern = bytes(range(256)) * (16 * MB // 256)
        r.buf[:] = pattern
        fd = os.open(r.path, os.O_RDWR)
        try:
            mm = map_for_write(fd, 16 * MB)
        finally:
            os.close(fd)
        zeros = b"\x5a" * (16 * MB)  # (written: reading it faults no page in)
        try:
            with memoryview(mm) as view:
                assert view == pattern  # populating changed nothing
                before = _minor_faults()
                view[:] = zeros  # every page already mapped writable: no faults
                assert _minor_faults() - before < 64
            assert bytes(r.buf[:4096]) == zeros[:4096]  # (the same pages as the owner's)
        finally:
            mm.close()


def test_unpopulated_mapping_faults_page_by_page() -> None:
    """The contrast the test above relies on: a plain mapping faults on first write."""
    with SharedRegion(staging_name("test-populate-plain"), 16 * MB, populate=True) as r:
        fd = os.open(r.path, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, 16 * MB, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        zeros = b"\x5a" * (16 * MB)  # (written: reading it faults no page in)
        try:
            before = _minor_faults()
            mm[:] = zeros
            assert _minor_faults() - before >= 16 * MB // 4096 // 2
        finally:
            mm.close()
        assert populate_for_write(r._mm) is True  # type: ignore[arg-type]
