"""A bare `@hydra.main` app over the packaged conf/: what Hydra's own BasicSweeper makes of
sweep command lines. `python tests/hydra_sweep_ref.py IN.json OUT.json`: IN holds a list of
command lines (each a list of arguments after `-m`, `--config-dir DIR` allowed); OUT gets, for
each, {"points": [[override, ...], ...]} (each job's `hydra.overrides.task`, in launch order)
or {"error": "..."} (what Hydra refused the sweep with). One process runs them all: Hydra's
multirun is called as `python app.py -m ARGS` calls it, once per command line.
For tests/test_sweep_grammar.py: the app is Hydra's, not ours, so what it finds is Hydra's word."""
import io
import json
import random
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from orchestrator.config.compose import register  # noqa: E402  the schema, launchers, schedules, recipes
from orchestrator.config.paths import CONF_DIR  # noqa: E402

register()
JOBS: list = []


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
def app(cfg) -> None:
    JOBS.append(list(HydraConfig.get().overrides.task))


def main() -> None:
    src, dst = Path(sys.argv[1]), Path(sys.argv[2])
    lines, out = json.loads(src.read_text()), []
    for i, args in enumerate(lines):
        JOBS.clear()
        random.seed(0)  # shuffle() draws from Python's random: the same seed on both sides
        sys.argv = ["app", "-m", *args, f"hydra.sweep.dir={dst}.d/{i}"]
        err = io.StringIO()
        try:
            with redirect_stdout(io.StringIO()), redirect_stderr(err):
                app()
            out.append({"points": list(JOBS)})
        except SystemExit:  # Hydra printed why and exited
            out.append({"error": err.getvalue().strip()})
    dst.write_text(json.dumps(out))


if __name__ == "__main__":
    main()
