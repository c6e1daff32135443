VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck unit bench clean

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

test: lint typecheck unit

bench: $(STAMP)
	$(PY) benchmarks/codec_bench.py

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
