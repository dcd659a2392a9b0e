"""RejectLog: every rejection counted exactly, lines rate-limited, summaries written by `run`."""

from __future__ import annotations

import anyio
import anyio.lowlevel
from structlog.testing import capture_logs

from kvd.logs import RejectLog


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_flood_is_counted_exactly_and_logged_in_a_few_lines() -> None:
    counters: dict[str, int] = {"side_rejected": 5}
    clock = Clock()
    rejects = RejectLog(counters, 10.0, clock=clock)
    with capture_logs() as lines:
        for i in range(10_000):
            clock.now += 0.001
            kind = "RemoteProtocolError" if i % 2 else "VersionMismatch"
            rejects.reject(
                "sidechannel", "side_rejected", "side_request_rejected", kind, error=f"bad {i}"
            )
        assert counters["side_rejected"] == 5 + 10_000
        assert [(x["event"], x["kind"], x["error"]) for x in lines] == [
            ("side_request_rejected", "VersionMismatch", "bad 0"),
            ("side_request_rejected", "RemoteProtocolError", "bad 1"),
        ]
        assert all(x["log_level"] == "warning" and x["actor"] == "sidechannel" for x in lines)
        clock.now += 10.0
        rejects.flush()
        summaries = lines[2:]
        assert sorted((x["kind"], x["suppressed"], x["summary"]) for x in summaries) == [
            ("RemoteProtocolError", 4999, True),
            ("VersionMismatch", 4999, True),
        ]
        assert all("error" not in x and x["interval_s"] == 10.0 for x in summaries)


def test_a_line_after_a_late_flush_carries_the_count_and_close_writes_what_is_open() -> None:
    counters: dict[str, int] = {}
    clock = Clock()
    rejects = RejectLog(counters, 10.0, clock=clock)
    with capture_logs() as lines:
        for _ in range(3):
            rejects.reject("gateway", "ipc_rejected", "ipc_request_rejected", "no_session")
        clock.now += 11.0
        rejects.reject("gateway", "ipc_rejected", "ipc_request_rejected", "no_session")
        rejects.reject("gateway", "ipc_disconnects", "ipc_connection_lost", "x", level="info")
        rejects.reject("gateway", "ipc_disconnects", "ipc_connection_lost", "x", level="info")
        rejects.close()
    assert counters == {"ipc_rejected": 4, "ipc_disconnects": 2}
    assert [(x["event"], x.get("suppressed"), x["log_level"]) for x in lines] == [
        ("ipc_request_rejected", None, "warning"),
        ("ipc_request_rejected", 2, "warning"),
        ("ipc_connection_lost", None, "info"),
        ("ipc_connection_lost", 1, "info"),  # the summary close wrote
    ]


async def test_run_writes_the_summary_when_the_window_ends() -> None:
    counters: dict[str, int] = {}
    rejects = RejectLog(counters, 0.05)
    with capture_logs() as lines:
        async with anyio.create_task_group() as tg:
            tg.start_soon(rejects.run)
            await anyio.lowlevel.checkpoint()  # run is now waiting for a first rejection
            for _ in range(100):
                rejects.reject("notifier", "notifs_malformed", "notif_malformed", "garbage")
            # Poll the captured lines (nothing to wait on) against a generous deadline.
            with anyio.fail_after(10):
                while not any(x.get("summary") for x in lines):  # noqa: ASYNC110
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    assert counters == {"notifs_malformed": 100}
    assert [(x.get("summary", False), x.get("suppressed")) for x in lines] == [
        (False, None),
        (True, 99),
    ]
