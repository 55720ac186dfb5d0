"""The job's rendezvous store, in a process of its own: `python -m orchestrator.train.store PORT`.

Every copy of the model state initialises its torch world through it (under its own
prefix), and the groups that cross copies are rebuilt through it at every generation, so
it must outlive any rank: the launcher (or the SLURM supervisor) starts it and it serves
until stdin closes or it is killed. It prints its port once it listens.
"""
from __future__ import annotations

import sys
from datetime import timedelta


def main() -> None:
    from torch.distributed import TCPStore

    port = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    store = TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False, timeout=timedelta(hours=24))
    print(store.port, flush=True)
    sys.stdin.read()  # serve until the parent closes our stdin (or kills us)


if __name__ == "__main__":
    main()
