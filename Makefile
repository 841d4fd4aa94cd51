# Two commands do all set-up on a fresh clone: `make demo` and `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test bench clean

$(BIN)/python:
	$(shell command -v $(PY) >/dev/null 2>&1 || echo python3) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/python -m neuron_runtime.demo

test: install
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

bench: install
	@for b in benchmarks/*.py; do echo "== $$b" >&2; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info
