"""What happened to a run: failover.json (failovers, damaged checkpoints), and the same
events in TensorBoard. Torch-free, so a supervisor on a machine without torch records
them too, and the runtime's rank 0 records what only it sees."""
from __future__ import annotations

import fcntl
import json
import time
from pathlib import Path

from orchestrator import rundir


def read_events(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / rundir.FAILOVER_JSON
    try:
        events = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return [e for e in events if isinstance(e, dict)] if isinstance(events, list) else []


def record(run_dir: Path, event: dict) -> dict:
    """Append one event to failover.json (written whole, then renamed, under a lock: the
    supervisor and rank 0 both record) and to TensorBoard."""
    run_dir = Path(run_dir)
    event = {"time": time.time(), **event}
    with open(run_dir / ".failover.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        events = read_events(run_dir) + [event]
        rundir.write_json(run_dir / rundir.FAILOVER_JSON, events, default=str)
    _tensorboard(run_dir / rundir.TENSORBOARD, event, len(events))
    return event


def amend(run_dir: Path, when: float, fields: dict) -> None:
    """Add fields to the event recorded at `when` (a recovery time measured later)."""
    run_dir = Path(run_dir)
    with open(run_dir / ".failover.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        events = read_events(run_dir)
        for e in events:
            if e.get("time") == when:
                e.update(fields)
        rundir.write_json(run_dir / rundir.FAILOVER_JSON, events, default=str)


def _tensorboard(logdir: Path, event: dict, n: int) -> None:
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    step = int(event.get("resumed_from_step") or event.get("failed_after_step") or event.get("step") or 0)
    values = [Summary.Value(tag="failover/count", simple_value=float(n))]
    for key, tag in (("steps_lost", "failover/steps_lost"), ("recovery_s", "failover/recovery_s"),
                     ("ratio", "failover/straggler_ratio")):
        if isinstance(event.get(key), (int, float)):
            values.append(Summary.Value(tag=tag, simple_value=float(event[key])))
    if isinstance(event.get("new_layout"), dict) and "dp" in event["new_layout"]:
        values.append(Summary.Value(tag="failover/dp", simple_value=float(event["new_layout"]["dp"])))
    text = TensorProto(dtype=7, string_val=[json.dumps(event, indent=1, default=str).encode()],
                       tensor_shape={"dim": [{"size": 1}]})
    values.append(Summary.Value(tag="failover/text_summary", tensor=text, metadata=SummaryMetadata(
        plugin_data=SummaryMetadata.PluginData(plugin_name="text"))))
    logdir.mkdir(parents=True, exist_ok=True)
    writer = EventFileWriter(str(logdir), filename_suffix=".failover")
    writer.add_event(Event(wall_time=event["time"], step=step, summary=Summary(value=values)))
    writer.close()
