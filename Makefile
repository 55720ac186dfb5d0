# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU build of torch; an unpinned `torch` would pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0

.PHONY: demo test bench clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[test]'
	touch $@

demo: $(BIN)/.installed
	$(BIN)/orchestrate recipe=llama3_405b launcher=dry

test: $(BIN)/.installed
	$(BIN)/pytest -q

bench: $(BIN)/.installed
	for f in benchmarks/*.py; do echo "== $$f"; $(BIN)/python $$f || exit 1; done

clean:
	rm -rf $(VENV) outputs/* multirun
