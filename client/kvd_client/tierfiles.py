"""The disk tier's block files, as both the daemon and an engine read them.

A block is a file `<disk_path>/<hh>/<digest>.blk`: the block's bytes, then the namespace
and the key, then a trailer (magic, data length, checksum kind, and the checksum of the
bytes, namespace and key). The daemon writes it (a temp file renamed into place only
when whole) and rebuilds its index from the trailers at start; an engine that may read
the daemon's files (`TierClient`, `tiers.disk_client_reads`) reads a disk-tier hit
straight into its own memory and checks it with the same functions.

numpy is imported only where a `sum64` checksum is computed (the thin client imports
without it; a client without numpy does not read files itself).
"""

from __future__ import annotations

import hashlib
import os
import struct
import zlib
from typing import Final

__all__ = [
    "CHECKSUMS",
    "MAGIC",
    "SUFFIX",
    "TMP_SUFFIX",
    "TRAILER",
    "block_checksum",
    "block_path",
    "can_sum64",
    "file_bytes",
    "read_block",
    "read_trailer",
    "trailer_of",
]

TierKey = tuple[bytes, bytes]
"""(namespace, key)."""

MAGIC: Final = b"KVDTIER1"
TRAILER: Final = struct.Struct("<8sQQHHI")
"""magic, data bytes, checksum (of data, namespace, key), namespace length, key length,
checksum kind; 32 bytes."""
CHECKSUMS: Final = {"none": 0, "sum64": 1, "crc32": 2}
"""`tiers.disk_checksum` -> the kind recorded in a file's trailer."""
SUFFIX: Final = ".blk"
TMP_SUFFIX: Final = ".tmp"
_MASK64: Final = (1 << 64) - 1


def block_path(root: str, key: TierKey) -> str:
    """Where the disk tier keeps `key`'s block (a digest: keys may be long)."""
    ns, k = key
    h = hashlib.blake2b(len(ns).to_bytes(2, "big") + ns + k, digest_size=20).hexdigest()
    return os.path.join(root, h[:2], h + SUFFIX)


def file_bytes(key: TierKey, nbytes: int) -> int:
    """The size of the file of a block of `nbytes` bytes under `key`."""
    return nbytes + len(key[0]) + len(key[1]) + TRAILER.size


def trailer_of(key: TierKey, nbytes: int, kind: int, checksum: int) -> bytes:
    ns, k = key
    return ns + k + TRAILER.pack(MAGIC, nbytes, checksum, len(ns), len(k), kind)


def read_trailer(fd: int, size: int) -> tuple[TierKey, int, tuple[int, int]] | str:
    """(key, data bytes, (checksum kind, checksum)) from a block file of `size` bytes, or
    why it is bad."""
    if size < TRAILER.size:
        return "truncated"
    raw = os.pread(fd, TRAILER.size, size - TRAILER.size)
    if len(raw) != TRAILER.size:
        return "truncated"
    magic, nbytes, checksum, ns_len, key_len, kind = TRAILER.unpack(raw)
    if magic != MAGIC:
        return "bad magic"
    if kind not in CHECKSUMS.values():
        return "unknown checksum kind"
    if size != nbytes + ns_len + key_len + TRAILER.size or ns_len == 0 or key_len == 0:
        return "wrong length"
    names = os.pread(fd, ns_len + key_len, nbytes)
    if len(names) != ns_len + key_len:
        return "truncated"
    return (names[:ns_len], names[ns_len:]), nbytes, (kind, checksum)


def can_sum64() -> bool:
    """Whether this process can compute `sum64` checksums (numpy is importable)."""
    try:
        import numpy  # noqa: F401
    except ImportError:
        return False
    return True


def block_checksum(kind: int, data: memoryview, key: TierKey) -> int:
    """A block's checksum of `kind` over its bytes, namespace and key. sum64: the 64-bit
    wrapping sum of its little-endian words (about memory speed: catches flipped bits and
    zeroed or cut data, not reordered words); crc32: CRC-32 (stronger, ~2 GB/s here).
    Both release the GIL (numpy's reduction, zlib)."""
    names = len(key[0]).to_bytes(2, "little") + key[0] + key[1]
    if kind == CHECKSUMS["crc32"]:
        return zlib.crc32(names, zlib.crc32(data))
    if kind == CHECKSUMS["sum64"]:
        import numpy as np

        n8 = len(data) // 8 * 8
        total = int(np.add.reduce(np.frombuffer(data[:n8], dtype="<u8"), dtype=np.uint64))
        tail = bytes(data[n8:])
        if tail:
            total += int.from_bytes(tail, "little")
        total += int.from_bytes(hashlib.blake2b(names, digest_size=8).digest(), "little")
        return total & _MASK64
    return 0


def read_block(root: str, key: TierKey, dest: memoryview, *, verify: bool = True) -> str:
    """Read `key`'s block file under `root` straight into `dest` (exactly the block's
    bytes, as long as `dest`) and check it against its trailer: the key, the length and
    (`verify`) its checksum. "" when the bytes in `dest` are the block's, else why not
    (`dest` then holds garbage). Never raises for a bad or missing file."""
    try:
        fd = os.open(block_path(root, key), os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        return f"open: {exc.strerror}"
    try:
        size = os.fstat(fd).st_size
        if size != file_bytes(key, len(dest)):
            return "wrong length"
        # the data first (sequential), then the trailer (usually read ahead by then)
        done = 0
        while done < len(dest):
            n = os.preadv(fd, [dest[done:]], done)
            if n <= 0:
                return "truncated"
            done += n
        got = read_trailer(fd, size)
        if isinstance(got, str):
            return got
        if got[0] != key or got[1] != len(dest):
            return "names another block"
        kind, want = got[2]
        if verify and kind != CHECKSUMS["none"] and block_checksum(kind, dest, key) != want:
            return "checksum mismatch"
        return ""
    except OSError as exc:
        return f"read: {exc.strerror}"
    finally:
        os.close(fd)
