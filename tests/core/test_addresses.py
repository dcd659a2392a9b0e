"""Peer addresses named by untrusted input: IP literals and RFC 1123 host names only."""

from __future__ import annotations

import pytest
from kvd_client import wire

from kvd.core.addresses import address_problem, host_problem, peer_address_problem, port_problem

GOOD_HOSTS = [
    "127.0.0.1",
    "10.0.0.5",
    "::1",
    "[::1]",
    "fe80::1",
    "2001:db8::42",
    "localhost",
    "prefill-0",
    "p0.kvd.svc.cluster.local",
    "p0.kvd.svc.cluster.local.",  # fully qualified, trailing dot
    "3com.example",  # RFC 1123 allows a leading digit
    "a" * 63 + ".example",
    ".".join(["a" * 63] * 3) + "." + "b" * 61,  # 253 characters
]

BAD_HOSTS = {
    "": "is empty",
    "not a host": "spaces",
    " 10.0.0.1": "spaces",
    "10.0.0.1 ": "spaces",
    "host\tname": "spaces",
    "host\nname": "spaces",
    "host\x00name": "control",
    "host\x7fname": "control",
    "höst.example": "non-ASCII",
    "my_host": "neither an IP address nor a host name",
    "-leading.example": "neither",
    "trailing-.example": "neither",
    "a..b": "neither",
    ".": "neither",
    "a" * 64 + ".example": "neither",  # a label of 64
    ".".join(["a" * 63] * 4): "characters",  # 255
    "x" * 4096: "characters",
    "10.0.0.300": "not a valid IP address",
    "1.2.3.4.5": "not a valid IP address",
    "127.000.0.1": "not a valid IP address",
    "[10.0.0.1": "neither",
    "[not-an-ip]": "not a valid IP address",
    "fe80::1%eth0": "not a valid IP address",  # zone index: meaningless to a peer
    "::g": "not a valid IP address",
    "host:5600": "not a valid IP address",
    "tcp://10.0.0.1": "not a valid IP address",
}


@pytest.mark.parametrize("host", GOOD_HOSTS)
def test_ip_literals_and_host_names_are_accepted(host: str) -> None:
    assert host_problem(host) is None


@pytest.mark.parametrize("host", list(BAD_HOSTS))
def test_anything_else_is_refused_with_a_reason(host: str) -> None:
    why = host_problem(host)
    assert why is not None and BAD_HOSTS[host] in why
    assert len(why) < 300  # an untrusted host is cut short in the message


@pytest.mark.parametrize("port", [1, 5600, 65535])
def test_ports(port: int) -> None:
    assert port_problem(port) is None


@pytest.mark.parametrize("port", [0, -1, 65536])
def test_port_zero_and_out_of_range_are_refused(port: int) -> None:
    assert port_problem(port) is not None


def test_address_problem_names_the_field_at_fault() -> None:
    assert address_problem("10.0.0.1", 5600, "h", "p") is None
    assert (address_problem("bad host", 5600, "X.h", "X.p") or "").startswith("X.h ")
    assert (address_problem("10.0.0.1", 0, "X.h", "X.p") or "").startswith("X.p ")


REQUESTS: list[tuple[wire.Record, str, str]] = [
    (wire.Track("r", "e", "not a host", 5600, "", ""), "Track.peer_host", "Track.peer_port"),
    (
        wire.RegisterPush("r", "e", (1,), "not a host", 5600, "", ""),
        "RegisterPush.peer_host",
        "RegisterPush.peer_port",
    ),
    (
        wire.Pull("r", "e", (1,), "not a host", 5600, "", "r", (1,)),
        "Pull.peer_host",
        "Pull.peer_port",
    ),
    (wire.ECEnsure("h", "not a host", 5600, 1, ""), "ECEnsure.peer_host", "ECEnsure.peer_port"),
    (wire.PingPeer("not a host", 5600, 1.0), "PingPeer.host", "PingPeer.port"),
]


@pytest.mark.parametrize("msg,host_field,port_field", REQUESTS, ids=lambda v: type(v).__name__)
def test_every_request_naming_a_peer_is_checked(
    msg: wire.Record, host_field: str, port_field: str
) -> None:
    assert (peer_address_problem(msg) or "").startswith(f"{host_field} 'not a host'")
    fields = {f: getattr(msg, f) for f in msg.__dataclass_fields__}
    host_key, port_key = host_field.split(".")[1], port_field.split(".")[1]
    good = type(msg)(**{**fields, host_key: "10.0.0.1"})
    assert peer_address_problem(good) is None
    no_port = type(msg)(**{**fields, host_key: "10.0.0.1", port_key: 0})
    assert (peer_address_problem(no_port) or "").startswith(f"{port_field} 0 ")


def test_requests_naming_no_peer_are_not_checked() -> None:
    assert peer_address_problem(wire.Finish("r", "e", (1,))) is None
    assert peer_address_problem(wire.GetStatus("status")) is None
