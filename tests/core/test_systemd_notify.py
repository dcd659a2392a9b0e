"""kvd.adapters.systemd: sd_notify datagrams received on real AF_UNIX sockets."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvd.adapters import systemd


@pytest.fixture
def notify_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A datagram socket bound in tmp_path and named in $NOTIFY_SOCKET, like systemd's."""
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        yield sock


def _received(sock: socket.socket) -> str:
    return sock.recv(4096).decode()


def test_notify_without_socket_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert systemd.notify("READY=1") is False
    assert systemd.ready() is False
    assert systemd.stopping() is False
    assert systemd.watchdog_ping() is False
    assert systemd.status("x") is False
    monkeypatch.setenv("NOTIFY_SOCKET", "")
    assert systemd.notify("READY=1") is False


def test_notify_sends_state(notify_socket: socket.socket) -> None:
    assert systemd.notify("READY=1\nSTATUS=hello") is True
    assert _received(notify_socket) == "READY=1\nSTATUS=hello"


def test_helpers(notify_socket: socket.socket) -> None:
    assert systemd.ready()
    assert _received(notify_socket) == "READY=1"
    assert systemd.ready("serving on /run/kvd/kvd.sock")
    assert _received(notify_socket) == "READY=1\nSTATUS=serving on /run/kvd/kvd.sock"
    assert systemd.status("draining 3 leases")
    assert _received(notify_socket) == "STATUS=draining 3 leases"
    assert systemd.watchdog_ping()
    assert _received(notify_socket) == "WATCHDOG=1"
    assert systemd.stopping()
    assert _received(notify_socket) == "STOPPING=1"


def test_status_cannot_inject_assignments(notify_socket: socket.socket) -> None:
    assert systemd.status("a\nREADY=1")
    assert _received(notify_socket) == "STATUS=a READY=1"


def test_abstract_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"kvd-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert systemd.ready("up")
        assert _received(sock) == "READY=1\nSTATUS=up"


def test_send_failure_returns_false(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens"))
    assert systemd.notify("READY=1") is False
    monkeypatch.setenv("NOTIFY_SOCKET", "vsock:2:1234")
    assert systemd.notify("READY=1") is False


def test_full_socket_does_not_block(notify_socket: socket.socket) -> None:
    """A receiver that stops reading makes notify return False, never hang the loop."""
    results = [systemd.notify("WATCHDOG=1" + "x" * 1000) for _ in range(10_000)]
    assert results[0] is True
    assert results[-1] is False


@pytest.mark.parametrize(
    ("usec", "pid", "expected"),
    [
        (None, None, None),
        ("30000000", None, 15.0),
        ("30000000", "self", 15.0),
        ("30000000", "other", None),
        ("30000000", "garbage", None),
        ("0", None, None),
        ("-5", None, None),
        ("soon", None, None),
        ("1000000", "self", 0.5),
    ],
)
def test_watchdog_interval(
    monkeypatch: pytest.MonkeyPatch, usec: str | None, pid: str | None, expected: float | None
) -> None:
    for name, value in (("WATCHDOG_USEC", usec), ("WATCHDOG_PID", pid)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            value = {"self": str(os.getpid()), "other": str(os.getpid() + 1)}.get(value, value)
            monkeypatch.setenv(name, value)
    assert systemd.watchdog_interval() == expected
