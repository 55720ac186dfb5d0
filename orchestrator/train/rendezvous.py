"""The job's rendezvous store, in a process of its own:
`python -m orchestrator.train.rendezvous PORT HOST [SHARDS]` (HOST: 127.0.0.1 locally, the first
node's address on SLURM; never every interface).

Every copy of the model state initialises its torch world through it (under its own
prefix), and the groups that cross copies are rebuilt through it at every generation, so
it must outlive any rank: the launcher (or the SLURM supervisor) starts it and it serves
until stdin closes or it is killed. It runs SHARDS TCPStore servers (rundir.store_shards: one
per ~4k ranks), each on its own port and its own server thread: every key of one group lives on
one shard (rundir.store_shard), so a generation's rebuild runs on all of them at once instead of
queueing at one server, and each server holds only its share of the ranks' connections. It
prints its ports, space-separated, once they listen. A line `set KEY VALUE` on stdin sets a key
on every shard (the coordinator's abort of a generation, launch/control.JobServices._abort: each
rank watches it on its own copy's shard).

torch's TCPStore has no authentication: whoever reaches the port can read and write keys.
So nothing that decides membership or commits lives here (that is the coordinator's,
authenticated, launch/control.py), and every key of a job is under its own prefix
(ORCH_JOB, train/replicas.connect_store).
"""
from __future__ import annotations

import sys
from datetime import timedelta


def main() -> None:
    import socket

    from torch.distributed import TCPStore

    port = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    host = sys.argv[2] if len(sys.argv) > 2 else "127.0.0.1"
    shards = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    stores, socks = [], []
    for i in range(shards):
        # TCPStore alone listens on every interface whatever its host: hand it a socket bound to `host`.
        sock = socket.create_server((host, port + i if port else 0), backlog=4096)
        socks.append(sock)
        stores.append(TCPStore(host, sock.getsockname()[1], is_master=True, wait_for_workers=False,
                               timeout=timedelta(hours=24), master_listen_fd=sock.fileno()))
    print(" ".join(str(s.port) for s in stores), flush=True)
    for line in sys.stdin:  # serve until the parent closes our stdin (or kills us)
        parts = line.split(" ", 2)
        if len(parts) == 3 and parts[0] == "set":
            for s in stores:
                s.set(parts[1], parts[2].strip())


if __name__ == "__main__":
    main()
