"""Late-write experiment: role target|initiator. Files in sys.argv[2] (a dir)."""
import json, os, subprocess, sys, time
import numpy as np

role, d, mode = sys.argv[1], sys.argv[2], sys.argv[3]
N = int(os.environ.get("LW_BYTES", str(64 << 20)))
SMALL = 4096
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
from nixl._api import nixl_agent, nixl_agent_config

t0 = float(open(f"{d}/t0").read())
def now(): return time.time() - t0
def log(*a): print(f"[{role} {now():7.3f}]", *a, flush=True)
def wait_file(p, timeout=60):
    end = time.time() + timeout
    while not os.path.exists(p):
        if time.time() > end: raise SystemExit(f"no {p}")
        agent.get_new_notifs(); time.sleep(0.005)
    time.sleep(0.05)
    return open(p, "rb").read()

agent = nixl_agent(f"lw-{role}", nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, num_threads=0, backends=[]))
bp = {"ucx_error_handling_mode": os.environ.get("LW_ERRMODE", "peer")}
if os.environ.get("LW_FORCE"): bp["ucx_ep_close_force"] = "true"
agent.create_backend("UCX", bp)
buf = np.zeros(N + SMALL, dtype=np.uint8)
OP = os.environ.get("LW_OP", "WRITE")
if role == "initiator":
    buf[:N] = 0xAB if OP == "WRITE" else 0; buf[N:] = 0x11
elif OP == "READ":
    buf[:N] = 0xCD
addr = buf.ctypes.data
reg = agent.register_memory([(addr, N + SMALL, 0, "")], "DRAM")
open(f"{d}/{role}.md.tmp", "wb").write(agent.get_agent_metadata()); os.rename(f"{d}/{role}.md.tmp", f"{d}/{role}.md")
open(f"{d}/{role}.addr", "w").write(str(addr))

def ip(state):
    r = subprocess.run(["ip", "link", "set", os.environ["LW_VETH"], state], capture_output=True, text=True)
    log("link", state, r.returncode, r.stderr.strip())

if role == "target":
    peer = agent.add_remote_agent(wait_file(f"{d}/initiator.md")); peer = peer.decode() if isinstance(peer, bytes) else peer
    # the target talks back (as kvd's D does: notifications), so it holds an endpoint to the initiator
    agent.send_notif(peer, b"hello-from-target")
    last, lastc, did = 0.0, -1, set()
    end = None
    while True:
        for p, msgs in agent.get_new_notifs().items():
            log("notif from", p, msgs)
        for c in ("remove", "destroy", "stop"):
            if c not in did and os.path.exists(f"{d}/cmd.{c}"):
                did.add(c); log("cmd", c)
                if c == "remove":
                    try:
                        agent.remove_remote_agent(peer); log("target removed remote agent", peer)
                    except Exception as e: log("remove failed", type(e).__name__, e)
                if c == "destroy":
                    import gc
                    class _A:
                        def get_new_notifs(self): return {}
                    agent.deregister_memory(reg); del reg
                    agent = _A(); gc.collect(); log("target agent destroyed (sockets closed); buffer still mapped")
                if c == "stop": end = time.time() + 0.5
        if time.time() - last > 0.25:
            last = time.time()
            c = int(np.count_nonzero(buf[:N] == 0xAB))
            if c != lastc: log(f"target bytes landed: {c} / {N}"); lastc = c
            open(f"{d}/count", "w").write(str(c))
        if end and time.time() > end:
            c = int(np.count_nonzero(buf[:N] == 0xAB)); log(f"FINAL target bytes landed: {c} / {N}")
            break
        time.sleep(0.002)
else:
    peer = agent.add_remote_agent(wait_file(f"{d}/target.md")); peer = peer.decode() if isinstance(peer, bytes) else peer
    taddr = int(wait_file(f"{d}/target.addr"))
    def xfer(loff, roff, n, notif):
        l = agent.get_xfer_descs(np.array([[addr + loff, n, 0]], dtype=np.uint64), "DRAM")
        r = agent.get_xfer_descs(np.array([[taddr + roff, n, 0]], dtype=np.uint64), "DRAM")
        h = agent.initialize_xfer(OP if notif == b"big" else "WRITE", l, r, peer, notif)
        return h, agent.transfer(h)
    h, st = xfer(N, N, SMALL, b"warm")
    while st != "DONE":
        st = agent.check_xfer_state(h); agent.get_new_notifs()
        if st == "ERR": raise SystemExit("warm-up failed")
    agent.release_xfer_handle(h); log("warm-up done")
    time.sleep(0.5)
    if mode == "cma":
        import signal, threading
        open(f"{d}/initiator.pid", "w").write(str(os.getpid()))
        def freeze():
            time.sleep(float(os.environ.get("LW_STOP_AFTER", "0.01")))
            os.kill(os.getpid(), signal.SIGSTOP)
        threading.Thread(target=freeze, daemon=True).start()
        h, st = xfer(0, 0, N, b"big"); log("transfer() returned", st)
        while st == "PROC":
            st = agent.check_xfer_state(h); agent.get_new_notifs()
        log("big WRITE", st); agent.release_xfer_handle(h)
        time.sleep(1.0)
        open(f"{d}/cmd.stop", "w").close(); time.sleep(1.0)
        raise SystemExit(0)
    timeout = float(os.environ.get("LW_TIMEOUT", "1.5"))
    down_s = float(os.environ.get("LW_DOWN", "4"))
    ip("down"); t_down = time.time()
    h, st = xfer(0, 0, N, b"big"); log("posted big WRITE, state", st)
    released = False
    t_post = time.time()
    while True:
        try:
            st = agent.check_xfer_state(h)
        except Exception as e:
            st = f"EXC {type(e).__name__}: {e}"
        agent.get_new_notifs()
        if st != "PROC":
            log("big WRITE state", st, f"after {time.time()-t_post:.2f}s")
            if st != "DONE":
                agent.release_xfer_handle(h); log("released the failed handle")
            released = True
            break
        if mode != "wait" and time.time() - t_post > timeout:
            log(f"timeout {timeout}s: state still PROC -> abandon ({mode})")
            agent.release_xfer_handle(h); released = True; log("release_xfer_handle returned")
            if mode in ("remove", "both"):
                agent.remove_remote_agent(peer); log("initiator removed remote agent")
            if mode in ("target", "both"):
                open(f"{d}/cmd.remove", "w").close()
            if mode == "tdestroy":
                open(f"{d}/cmd.destroy", "w").close()
            break
        if mode == "wait" and time.time() - t_down > down_s:
            break
        time.sleep(0.001)
    while time.time() - t_down < down_s:
        agent.get_new_notifs()
        if not released and mode == "wait":
            st2 = agent.check_xfer_state(h)
            if st2 != st: log("state", st2); st = st2
        time.sleep(0.005)
    ip("up")
    end = time.time() + float(os.environ.get("LW_AFTER", "6"))
    while time.time() < end:  # keep progressing, as kvd's NIXL thread does
        agent.get_new_notifs()
        if not released:
            st2 = agent.check_xfer_state(h)
            if st2 != st: log("state", st2, f"{time.time()-t_post:.2f}s after post"); st = st2
        time.sleep(0.002)
    if os.environ.get("LW_RETRY"):
        def small(tag):
            try:
                h, st = xfer(N, N, SMALL, tag)
                t = time.time()
                while st == "PROC" and time.time() - t < 5:
                    st = agent.check_xfer_state(h); agent.get_new_notifs()
                agent.release_xfer_handle(h)
                return st
            except Exception as e:
                return f"EXC {type(e).__name__}: {e}"
        log("retry small WRITE on the old connection:", small(b"retry1"))
        try:
            agent.remove_remote_agent(peer)
        except Exception as e:
            log("remove failed", type(e).__name__, e)
        peer2 = agent.add_remote_agent(open(f"{d}/target.md", "rb").read())
        log("re-added target metadata; small WRITE:", small(b"retry2"))
    if OP == "READ":
        log(f"FINAL initiator bytes read into its buffer: {int(np.count_nonzero(buf[:N] == 0xCD))} / {N}")
    open(f"{d}/cmd.stop", "w").close()
    log("initiator done")
    time.sleep(1.0)
