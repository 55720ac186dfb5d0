# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU build of torch; an unpinned `torch` would pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0

.PHONY: demo test bench clean frameworks

$(BIN)/.installed: pyproject.toml
	@echo "== creating $(VENV) (about two minutes the first time)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@echo "== installing $(TORCH) (CPU build)"
	$(BIN)/pip install -q $(TORCH)
	@echo "== installing orchestrator and its test dependencies"
	$(BIN)/pip install -q -e '.[test]'
	touch $@

# The embedded default: train the tiny model on 2 emulated nodes x 4 devices with
# TP2 x PP2 x DP2 (gloo, one process per device); writes the plan, the pictures and
# the TensorBoard logs and prints where they are.
DEMO ?= hardware=cpu cluster.nodes=2 hardware.gpus_per_node=4 model=tiny \
	layout.tp=2 layout.pp=2 layout.dp=2 schedule=1f1b training.steps=30 launcher=local

demo: $(BIN)/.installed
	$(BIN)/orchestrate $(DEMO)

# Two workers, one test file each at a time: half of a serial run is one core starting
# Python and importing torch while the other idles. Same tests, same assertions.
WORKERS ?= 2
test: $(BIN)/.installed frameworks
	$(BIN)/pytest -q -n $(WORKERS) --dist loadfile

# torchtitan's and Megatron-Core's own releases for the tests, each in .frameworks/<release>/
# beside the project's torch (tests/frameworks.py says how and why).
frameworks: $(BIN)/.installed
	$(BIN)/python tests/frameworks.py

bench: $(BIN)/.installed
	for f in benchmarks/*.py; do echo "== $$f"; $(BIN)/python $$f || exit 1; done

clean:
	rm -rf $(VENV) .frameworks outputs/* multirun
