"""A rogue NIXL agent, run as its own process: it knows a daemon's NIXL metadata (which a
handshake carries in clear) but not the shared secret, takes any agent name it likes, and
sends the daemon the notifications it is given.

    python tests/integration/rogue_agent.py PLAN

PLAN is a msgpack map: {"name": str, "target": str, "md": bytes, "frames": [bytes, ...]}.
It prints the number of frames sent, then keeps its side of the connection progressing
(UCX delivers the frames only as both sides progress: an idle daemon polls rarely) until
its standard input ends (the test has seen what it waited for), at most 60 s, and exits
0 (non-zero if NIXL refused to send).
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import msgpack

from kvd.adapters.nixl_import import nixl_api

_api = nixl_api()
nixl_agent, nixl_agent_config = _api.nixl_agent, _api.nixl_agent_config


def main(plan_path: str) -> int:
    plan = msgpack.unpackb(Path(plan_path).read_bytes(), raw=False)
    agent = nixl_agent(plan["name"], nixl_agent_config(enable_prog_thread=False, backends=[]))
    agent.create_backend("UCX", {"ucx_error_handling_mode": "peer"})
    got = agent.add_remote_agent(plan["md"])
    target = got.decode() if isinstance(got, bytes) else str(got)
    assert target == plan["target"], (target, plan["target"])
    for frame in plan["frames"]:
        agent.send_notif(target, frame)
        agent.get_new_notifs()  # keep our side of the connection progressing
    print(len(plan["frames"]), flush=True)
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    deadline = time.monotonic() + 60.0
    while not done.is_set() and time.monotonic() < deadline:
        agent.get_new_notifs()
        time.sleep(0.005)
    agent.remove_remote_agent(target)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
