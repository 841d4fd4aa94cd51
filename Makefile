# Two commands do all set-up on a fresh clone: `make demo` and `make test` (README's quickstart).
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)

# torch==2.13.0 is pinned in pyproject.toml: pip takes the CPU build from this machine's wheel directory.
# .ci/constraints.txt pins the whole environment the suite was last run with (torch's +cpu build
# included): installs are reproducible, and pip never backtracks into a CUDA build of torch while
# reconciling boto3/botocore/aiobotocore. Regenerate it with `pip freeze` after a deliberate upgrade.
$(STAMP): pyproject.toml .ci/constraints.txt | $(BIN)/python
	$(BIN)/python -m pip install -q -c .ci/constraints.txt -e '.[test]'
	touch $(STAMP)

# The native hit path (C++, built with the host compiler once per torch install; seconds when built).
install: $(STAMP)
	$(BIN)/python -m neuron_runtime._native

demo: install
	$(BIN)/python -m neuron_runtime.demo

# The tests start what they need themselves (moto S3 and gRPC servers on 127.0.0.1, subprocess "hosts").
test: install
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

bench: install
	@for b in benchmarks/[!_]*.py; do echo "== $$b" >&2; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info
