"""kvd's error hierarchy, shared by the daemon and the thin client.

Every error maps to one wire error code (`ErrorCode`), so a failure raised inside the
daemon reaches the client as the same type. Errors say whose fault they are: a
`LocalProtocolError` means this side broke the protocol, a `RemoteProtocolError` means
the other side did.
"""

from __future__ import annotations

import enum
from typing import ClassVar, Final


class ErrorCode(enum.IntEnum):
    """Wire error codes. Values are part of the protocol: never renumber."""

    PROTOCOL = 1
    """The message could not be decoded or validated."""
    VERSION = 2
    """The peer speaks another protocol version."""
    BUSY = 3
    """A mailbox was full; retry later. Nothing was done."""
    NOT_FOUND = 4
    """The request, region or peer named does not exist."""
    INVALID = 5
    """The message was well formed but its values are impossible (bad layout, ids out of range)."""
    AUTH = 6
    """The peer could not prove the shared secret."""
    INCOMPATIBLE = 7
    """The two sides' compatibility hashes differ."""
    TRANSFER = 8
    """A transfer failed."""
    LEASE_EXPIRED = 9
    """The blocks' lease expired before the transfer completed."""
    TIMEOUT = 10
    """An operation did not complete in time."""
    INTERNAL = 11
    """A bug in kvd; the daemon logged the details."""
    SHUTTING_DOWN = 12
    """The daemon is shutting down and accepts no new work."""


class KvdError(Exception):
    """Base of every error kvd raises on purpose."""

    code: ClassVar[ErrorCode] = ErrorCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message: Final = message


class ProtocolError(KvdError):
    """A message could not be decoded or broke the protocol."""

    code = ErrorCode.PROTOCOL


class LocalProtocolError(ProtocolError):
    """This side tried to send something the protocol forbids (our bug)."""


class RemoteProtocolError(ProtocolError):
    """The other side sent something the protocol forbids (their bug, or an attack)."""


class VersionMismatch(RemoteProtocolError):
    code = ErrorCode.VERSION


class Busy(KvdError):
    """A bounded mailbox was full. Nothing was done; the caller may retry."""

    code = ErrorCode.BUSY


class NotFound(KvdError):
    code = ErrorCode.NOT_FOUND


class InvalidRequest(KvdError):
    """Well-formed but impossible: a bad layout, a block id outside its region, ..."""

    code = ErrorCode.INVALID


class AuthError(KvdError):
    code = ErrorCode.AUTH


class Incompatible(KvdError):
    code = ErrorCode.INCOMPATIBLE


class TransferError(KvdError):
    code = ErrorCode.TRANSFER


class LeaseExpired(TransferError):
    code = ErrorCode.LEASE_EXPIRED


class Timeout(KvdError):
    code = ErrorCode.TIMEOUT


class DaemonUnavailable(KvdError):
    """No daemon listens at the client's socket (missing, not permitted, or stale); raised
    by the client itself, never sent on the wire."""

    code = ErrorCode.NOT_FOUND


class ShuttingDown(KvdError):
    code = ErrorCode.SHUTTING_DOWN


_BY_CODE: Final[dict[ErrorCode, type[KvdError]]] = {
    ErrorCode.PROTOCOL: ProtocolError,
    ErrorCode.VERSION: VersionMismatch,
    ErrorCode.BUSY: Busy,
    ErrorCode.NOT_FOUND: NotFound,
    ErrorCode.INVALID: InvalidRequest,
    ErrorCode.AUTH: AuthError,
    ErrorCode.INCOMPATIBLE: Incompatible,
    ErrorCode.TRANSFER: TransferError,
    ErrorCode.LEASE_EXPIRED: LeaseExpired,
    ErrorCode.TIMEOUT: Timeout,
    ErrorCode.INTERNAL: KvdError,
    ErrorCode.SHUTTING_DOWN: ShuttingDown,
}


def error_from_code(code: int, message: str) -> KvdError:
    """Rebuild the typed error a wire error reply names (unknown codes become KvdError)."""
    try:
        cls = _BY_CODE[ErrorCode(code)]
    except ValueError:
        cls = KvdError
    return cls(message)
