"""A fuzz of the control protocol against a live Coordinator and ControlServer (the real
modules, over loopback sockets): R emulated copy leaders commit S steps while an attacker
interleaves unsigned, forged, replayed, malformed and out-of-protocol messages (including
issue #28's `{"op": "join", "copy": 7, "gen": 0, "now": true}`). Prints the counts: every
bad line dropped and counted once, the commits in order, no membership change.

    python benchmarks/control_fuzz.py [--leaders 64] [--steps 200] [--seed 0]
    python benchmarks/control_fuzz.py --address HOST:PORT --seconds 20   # at a live run (no key)
"""
from __future__ import annotations

import argparse
import json
import random
import secrets
import socket
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.launch.control import ControlServer, Coordinator, Decision  # noqa: E402
from orchestrator.train import wire  # noqa: E402

DOS = b'{"op": "join", "copy": 7, "gen": 0, "now": true}\n'


def _send(addr: tuple, lines: list[bytes]) -> None:
    with socket.create_connection(addr, timeout=5) as s:
        s.sendall(b"".join(lines))
        time.sleep(0.01)


def outsider_lines(rng: random.Random, captured: bytes | None) -> list[bytes]:
    """What someone without the key can send: each line is dropped and counted once."""
    bad_key = secrets.token_bytes(32)
    step = rng.randrange(1000)
    junk = bytes(rng.randrange(1, 256) for _ in range(rng.randrange(1, 200))).replace(b"\n", b" ")
    lines = [DOS, b'{"op":"commit","copy":0,"gen":0,"step":%d,"sums":[0,1,0]}\n' % step,
             wire.encode(bad_key, {"op": "commit", "copy": 0, "gen": 0, "step": step, "sums": [0.0, 1.0, 0.0]},
                         secrets.token_hex(16), 1),
             wire.encode(bad_key, {"op": "failed", "copy": 1, "gen": 0, "step": step}, secrets.token_hex(16), 2),
             b"0" * 64 + b" abc 1 {\"op\":\"join\",\"copy\":7,\"gen\":0,\"now\":true}\n",
             junk + b"\n", b"{not json\n", b"[1, 2, 3]\n", b'{"body": {"op": "join"}, "mac": 5}\n']
    if captured:  # a line sniffed off a leader's connection, sent again on another
        lines.append(captured)
    return [rng.choice(lines) for _ in range(rng.randrange(1, 6))]


def insider_lines(client: wire.Client, key: bytes, rng: random.Random) -> list[bytes]:
    """Signed, on its own connection, but out of protocol: dropped and counted once each."""
    bodies = [{"op": "explode", "copy": 0, "gen": 0}, {"op": "commit", "copy": 99, "gen": 0, "step": 0,
                                                         "sums": [0.0, 1.0, 0.0]},
              {"op": "commit", "copy": 0, "gen": 7, "step": 0, "sums": [0.0, 1.0, 0.0]},
              {"op": "commit", "copy": 99, "gen": 0, "step": 0, "sums": ["x", 1, 0]},
              {"op": "join", "copy": 7, "gen": 0, "now": True}, {"op": "bye", "copy": 1, "gen": -1},
              {"op": "commit", "copy": "0", "gen": 0, "step": 0}]
    out = []
    for _ in range(rng.randrange(1, 4)):
        client.seq += 1
        line = wire.encode(key, rng.choice(bodies), client.nonce, client.seq)
        out += [line, line] if rng.random() < 0.3 else [line]  # the second copy: replayed on this connection
    return out


class Leader(threading.Thread):
    def __init__(self, addr: str, key: bytes, copy: int, steps: int):
        super().__init__(daemon=True)
        self.client, self.copy, self.steps = wire.Client(addr, key), copy, steps
        self.answers: list[dict] = []
        self.last_line: bytes | None = None

    def run(self) -> None:
        for step in range(self.steps):
            body = {"op": "commit", "copy": self.copy, "gen": 0, "step": step, "sums": [float(self.copy + step), 1.0,
                                                                                        0.0]}
            self.last_line = wire.encode(self.client.key, body, self.client.nonce, self.client.seq + 1)
            self.answers.append(self.client.request(body, timeout_s=60))
        self.client.send({"op": "bye", "copy": self.copy, "gen": 0})


def fuzz(leaders: int = 16, steps: int = 50, seed: int = 0) -> dict:
    """R leaders commit `steps` steps under fire; the counts, and whether everything held."""
    rng, key = random.Random(seed), secrets.token_bytes(32)
    decisions: list = []
    coord = Coordinator(list(range(leaders)), "plan", lambda *a: decisions.append(a) or Decision(False, reason="x"),
                        quorum_s=5.0, commit_timeout_s=60.0)
    server = ControlServer(coord, key)
    addr = ("127.0.0.1", server.port)
    team = [Leader(server.address(), key, c, steps) for c in range(leaders)]
    for t in team:
        t.start()
    sent = 0
    insider = wire.Client(server.address(), key)
    while any(t.is_alive() for t in team) or sent < 40:
        if rng.random() < 0.5:
            lines = outsider_lines(rng, rng.choice(team).last_line)
            _send(addr, lines)
        else:
            lines = insider_lines(insider, key, rng)
            insider.sock.sendall(b"".join(lines))
            if insider.seq > 40:  # stay below the refused-lines limit of one connection
                insider.close()
                insider = wire.Client(server.address(), key)
        sent += len(lines)
    for t in team:
        t.join(timeout=120)
    deadline = time.monotonic() + 10
    while coord.counts()["dropped_total"] < sent and time.monotonic() < deadline:
        time.sleep(0.05)
    counts = coord.counts()
    want = [[(sum(c + s for c in range(leaders)) / leaders) for s in range(steps)]] * leaders
    got = [[a.get("loss") for a in t.answers] for t in team]
    in_order = all([(a.get("op"), a.get("step")) for a in t.answers] == [("commit", s) for s in range(steps)]
                   for t in team)
    server.close()
    return {"leaders": leaders, "steps": steps, "bad_lines_sent": sent, "dropped_total": counts["dropped_total"],
            "dropped": counts["dropped"], "commits": counts["commits"], "generation": counts["generation"],
            "decisions": len(decisions), "commits_in_order": in_order, "losses_right": got == want}


def at_address(address: str, seconds: float, seed: int = 0) -> int:
    """Outsider lines at a live run's coordinator (what anyone on the network can do): lines sent."""
    host, port = address.rsplit(":", 1)
    rng, sent, end = random.Random(seed), 0, time.monotonic() + seconds
    while time.monotonic() < end:
        lines = outsider_lines(rng, None)
        try:
            _send((host, int(port)), lines)
        except OSError:
            break  # the run ended
        sent += len(lines)
        time.sleep(0.02)
    return sent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--leaders", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--address")
    ap.add_argument("--seconds", type=float, default=20)
    a = ap.parse_args()
    if a.address:
        print(json.dumps({"address": a.address, "bad_lines_sent": at_address(a.address, a.seconds, a.seed)}))
        return
    print(json.dumps(fuzz(a.leaders, a.steps, a.seed), indent=1))


if __name__ == "__main__":
    main()
