"""The thin client stays thin: its wire schema pulls in nothing of the daemon (STYLE.md 9)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvd_client import wire

FORBIDDEN = ("kvd", "nixl", "torch", "anyio", "structlog", "numpy")

PROBE = """
import json, sys
import kvd_client, kvd_client.wire, kvd_client.errors
forbidden = {forbidden!r}
print(json.dumps({{
    "leaked": sorted(m for m in sys.modules if m.split(".")[0] in forbidden),
    "wire": kvd_client.wire.__file__,
    "msgpack": "msgpack" in sys.modules,
}}))
"""


def test_client_imports_nothing_of_the_daemon(tmp_path: Path) -> None:
    client_root = Path(wire.__file__).resolve().parents[1]
    env = dict(os.environ)
    # Run from an empty directory so the repository root (and `kvd`) is not on sys.path
    # by accident, but find this checkout's client first.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(client_root), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", PROBE.format(forbidden=FORBIDDEN)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert Path(result["wire"]).resolve() == Path(wire.__file__).resolve()
    assert result["msgpack"], "the probe did not import the wire module"
    assert result["leaked"] == []
