# Two commands do all set-up on a fresh clone: `make demo` and `make test` (README's quickstart).
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install servers demo test bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)

# torch==2.13.0 is pinned in pyproject.toml: pip takes the CPU build from this machine's wheel directory.
# .ci/constraints.txt pins the whole environment the suite was last run with (torch's +cpu build
# included): installs are reproducible, and pip never backtracks into a CUDA build of torch while
# reconciling boto3/botocore/aiobotocore. Regenerate it with `pip freeze` after a deliberate upgrade.
$(STAMP): pyproject.toml .ci/constraints.txt | $(BIN)/python
	$(BIN)/python -m pip install -q -c .ci/constraints.txt -e '.[test]'
	touch $(STAMP)

# The native hit path (C++, built with the host compiler once per torch install; seconds when built),
# and the aoti tier's shared runtime (what every compiled op links; ~10 s once per toolchain and torch).
install: $(STAMP)
	$(BIN)/python -m neuron_runtime._native
	$(BIN)/python -m neuron_runtime.compiler

demo: install
	$(BIN)/python -m neuron_runtime.demo

# Servers the tests start on 127.0.0.1 from Debian's packages: redis-server (redis:// stores) and nginx
# with WebDAV (http:// stores). Installed when missing and we are root (CI on a clean Debian machine);
# otherwise the tests that need them skip and say why.
servers:
	@missing=""; command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || missing="$$missing nginx-light"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "make: installing$$missing (Debian packages) for the tests" >&2; \
	    apt-get update -qq >&2 || true; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >&2; \
	  else echo "make: warning:$$missing missing and not root: the tests that need them will skip" >&2; fi; \
	fi

# The tests start what they need themselves (moto S3, gRPC, Redis and HTTP cache servers on 127.0.0.1,
# subprocess "hosts").
test: install servers
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

bench: install
	@for b in benchmarks/[!_]*.py; do echo "== $$b" >&2; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info
