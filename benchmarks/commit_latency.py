"""Commit latency against R copy leaders over real loopback sockets, for the coordinator of this
tree and for the one it replaced (git show eba4b6c:orchestrator/launch/control.py, loaded as a
temporary module): the before/after table of issue #24.

The coordinator runs in this process (the old one with its thread per connection); the R
leaders run in a child process, one thread driving all R connections with a selector, so
the leaders' own cost is small and the same for both: per step every leader sends its
commit (pre-encoded, signed for the new protocol), and the latency is from the last send to
the last answer received. Also measured: the loopback hop (one-way, half a ping-pong).
Both flat (every leader to the coordinator); the commit tree that holds 2,048 and 12,500
copies (train/tree.py) is measured by benchmarks/failover_sim.py, each aggregator on its own CPU.

    python benchmarks/commit_latency.py [--leaders 128,512,1024,2048] [--steps 20] [--old]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import secrets
import selectors
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from orchestrator.train import wire  # noqa: E402


def loopback_hop_s(n: int = 2000) -> float:
    a, b = socket.socketpair()
    t0 = time.perf_counter()
    for _ in range(n):
        a.sendall(b"x")
        b.recv(1)
        b.sendall(b"y")
        a.recv(1)
    return (time.perf_counter() - t0) / (2 * n)


OLD = "eba4b6c"  # the coordinator before it was rewritten (one thread per connection, O(R^2) a step)


def old_module():
    src = subprocess.run(["git", "show", f"{OLD}:orchestrator/launch/control.py"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "old_control.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("old_control", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["old_control"] = mod
    spec.loader.exec_module(mod)
    return mod


def _leaders(port: int, R: int, steps: int, key: bytes | None, out) -> None:
    """The child: R connections, per step all send, then wait for every answer."""
    sel, socks, lines, t_conn = selectors.DefaultSelector(), [], [], time.perf_counter()
    for c in range(R):
        s = socket.create_connection(("127.0.0.1", port), timeout=60)
        nonce = None
        if key is not None:
            f = s.makefile("rb")
            nonce = wire.decode(key, f.readline())[0]
        socks.append(s)
        lines.append([(wire.encode(key, {"op": "commit", "copy": c, "gen": 0, "step": k, "sums": [1.0, 1.0, 0.0]},
                                   nonce, k + 1) if key else
                       (json.dumps({"op": "commit", "copy": c, "gen": 0, "step": k}) + "\n").encode())
                      for k in range(steps)])
    connect_s = time.perf_counter() - t_conn
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    index = {s.fileno(): c for c, s in enumerate(socks)}
    lat = []
    for k in range(steps):
        for c, s in enumerate(socks):
            s.sendall(lines[c][k])
        t_sent, pending, buf = time.perf_counter(), set(range(R)), {}
        while pending:
            for ready, _ in sel.select(timeout=120):
                data = ready.fileobj.recv(65536)
                buf[ready.fd] = buf.get(ready.fd, b"") + data
                if b"\n" in buf[ready.fd]:
                    pending.discard(index[ready.fd])
                    buf[ready.fd] = b""
        lat.append(time.perf_counter() - t_sent)
    out.put({"connect_s": connect_s, "lat": lat})


def measure(R: int, steps: int, old: bool) -> dict:
    if old:
        mod = old_module()
        coord = mod.Coordinator(list(range(R)), "plan", lambda *a: None, quorum_s=60)
        server, key = mod.ControlServer(coord, host="127.0.0.1"), None
    else:
        from orchestrator.launch.control import ControlServer, Coordinator, Decision

        key = secrets.token_bytes(32)
        coord = Coordinator(list(range(R)), "plan", lambda *a: Decision(False, reason="the benchmark is over"),
                            quorum_s=60, commit_timeout_s=600, fan_in=R)  # flat: every leader to the coordinator
        server = ControlServer(coord, key)
    q = mp.get_context("fork").Queue()
    p = mp.get_context("fork").Process(target=_leaders, args=(server.port, R, steps, key, q))
    p.start()
    res = q.get(timeout=1800)
    p.join(60)
    server.close()
    lat = sorted(res["lat"][1:] or res["lat"])  # the first step warms up
    return {"coordinator": "old (eba4b6c)" if old else "new", "leaders": R, "steps": steps,
            "connect_s": round(res["connect_s"], 3), "commit_p50_s": lat[len(lat) // 2],
            "commit_p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))], "commits_kept": len(getattr(
                coord, "commits", {})) if old else 0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--leaders", default="128,512,1024,2048")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--old", action="store_true", help="also measure the replaced coordinator (eba4b6c)")
    ap.add_argument("--old-leaders", default="128,512,1024",
                    help="R for the replaced coordinator (its listen backlog of 5 makes 2,048 connects take minutes)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows = [{"loopback_hop_s": loopback_hop_s()}]
    for R in (int(x) for x in a.leaders.split(",")):
        rows.append(measure(R, a.steps, old=False))
        if a.old and str(R) in a.old_leaders.split(","):
            rows.append(measure(R, max(3, a.steps // 4) if R >= 1024 else a.steps, old=True))
    if a.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"loopback hop (one way): {rows[0]['loopback_hop_s'] * 1e6:.1f} us")
    print(f"{'coordinator':12s} {'R':>6s} {'connect s':>10s} {'commit p50':>11s} {'commit p99':>11s}")
    for r in rows[1:]:
        print(f"{r['coordinator']:12s} {r['leaders']:6d} {r['connect_s']:10.3f} {r['commit_p50_s'] * 1e3:9.2f}ms "
              f"{r['commit_p99_s'] * 1e3:9.2f}ms")


if __name__ == "__main__":
    main()
