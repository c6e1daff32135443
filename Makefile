VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck unit bench clean nginx

$(STAMP): pyproject.toml constraints-test.txt
	python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c constraints-test.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m daemon.demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

unit: $(STAMP)
	$(VENV)/bin/pytest -q

test: nginx lint typecheck unit

bench: $(STAMP)
	$(PY) benchmarks/codec_bench.py

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache

# Tests that serve a board with nginx need it on the machine (as root this installs it from apt).
nginx:
	@command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || [ "$$(id -u)" != 0 ] || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light >/dev/null) || \
	  echo "nginx could not be installed; nginx tests will be skipped"
