VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck unit bench clean system-deps native engine-deps

$(STAMP): pyproject.toml constraints-test.txt
	python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c constraints-test.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m patchswarm.daemon.demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

unit: $(STAMP)
	$(VENV)/bin/pytest -q

test: system-deps engine-deps lint typecheck native unit

bench: $(STAMP)
	$(PY) -m benchmarks.codec_bench

# The native build: the simulator's hot modules compiled by mypyc into a copy of the packages in
# build/native (simulations/build.py, docs/simulation.md#the-native-build).  Run a command on it with
#   PYTHONPATH=build/native:. .venv/bin/python -P -m benchmarks.sim_bench swarm --hosts 1000
# tests/system/test_native_build.py checks that it simulates event for event as the source does.
NATIVE := build/native
NATIVE_SRC := pyproject.toml $(wildcard protocol/*.py swarm/*.py simulations/*.py daemon/*.py)

native: $(NATIVE)/.built

$(NATIVE)/.built: $(STAMP) $(NATIVE_SRC)
	$(PY) -m patchswarm.simulations.build $(NATIVE)

clean:
	rm -rf $(VENV) build .mypy_cache .pytest_cache .ruff_cache

# Tests need nginx (serving a board), systemd-analyze (checking the unit), faketime (clock-skew
# faults) and Azurite (an Azure board); as root this installs
# them from apt (Azurite from npm), otherwise those tests are skipped with a message.
system-deps:
	@missing=""; \
	command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || missing="$$missing nginx-light"; \
	command -v systemd-analyze >/dev/null 2>&1 || missing="$$missing systemd"; \
	command -v faketime >/dev/null 2>&1 || missing="$$missing faketime"; \
	if [ -n "$$missing" ] && [ "$$(id -u)" = 0 ]; then \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null) || \
	  echo "could not install$$missing; the tests that need them will be skipped"; \
	fi
	@# Azurite, the Azure Storage emulator (tests/system/test_store_board_azure.py), from npm when npm is there.
	@if ! command -v azurite-blob >/dev/null 2>&1 && command -v npm >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  npm install -g --no-audit --no-fund --loglevel=error azurite@3.37.0 >/dev/null 2>&1 || \
	  echo "could not install azurite; the Azure board tests will be skipped"; \
	fi

# vLLM's own Python classes for the engine tests that import on CPU (tests/unit/daemon/
# test_param_sync_vllm.py, test_copy_drivers.py, tests/system/test_vllm_tp_loader.py): the wheels its
# imports need, each --no-deps, so nothing pulls another torch (vLLM pins a multi-GB CUDA one).  SGLang is
# left out: its utilities import triton (1 GB installed) for one payload test, which then skips.
ENGINE_STAMP := $(VENV)/.engine-deps
ENGINE_WHEELS := vllm==0.34.0 psutil==7.2.2 orjson==3.13.0 pybase64==1.5.1 pyzmq==27.3.0 cachetools==8.0.3 \
  cbor2==6.3.0 msgspec==0.23.0 cloudpickle==3.1.3 uvloop==0.23.0 py-cpuinfo==9.0.0 einops==0.8.2 \
  llguidance==1.9.1 xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
engine-deps: $(ENGINE_STAMP)

$(ENGINE_STAMP): $(STAMP)
	$(PIP) install --quiet --no-deps $(ENGINE_WHEELS) || \
	  echo "could not install vLLM's wheels; the tests against its classes will be skipped"
	touch $(ENGINE_STAMP)
