# One command runs the main job (`make demo`), one passes the tests (`make test`;
# `make test-unit` and `make test-live` run its two halves).
# Both set up what they need: Debian's libibverbs1/libnuma1 (and python3-venv, gcc and
# python3-dev where missing), a .venv, the pinned torch, the Mooncake wheel for this host,
# and this package with its C core.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  ?= torch==2.13.0
# The Mooncake wheel: the CUDA build where an NVIDIA driver is present, else the one without
# CUDA (`make MOONCAKE=cuda` or `MOONCAKE=cpu` picks one).
NVIDIA_MARKERS ?= /proc/driver/nvidia/version /dev/nvidia0
MOONCAKE ?= $(if $(wildcard $(NVIDIA_MARKERS)),cuda,cpu)
OTHER_MOONCAKE := mooncake-transfer-engine$(if $(filter cuda,$(MOONCAKE)),-non-cuda,)

.PHONY: setup demo test test-unit test-live bench doctor clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py $(wildcard native/*.c native/*.h)
	@PYTHON=$(PYTHON) VENV=$(VENV) scripts/ensure-debian-packages.sh
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	@# Both wheels install the same module: the other one goes first.
	$(PY) -m pip uninstall -q -y $(OTHER_MOONCAKE) 2>/dev/null || true
	$(PY) -m pip install -q -e ".[$(MOONCAKE),test]"
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/epd-transfer demo

test: $(STAMP)
	$(PY) -m pytest -q -ra tests

# Pure logic only: pytest-socket (a plugin pytest loads by itself) refuses sockets, and
# tests/unit/conftest.py refuses threads, processes and sleeps.
test-unit: $(STAMP)
	$(PY) -m pytest -q -ra tests/unit --disable-socket

test-live: $(STAMP)
	$(PY) -m pytest -q -ra tests/live

bench: $(STAMP)
	$(VENV)/bin/epd-transfer bench --quick

doctor: $(STAMP)
	$(VENV)/bin/epd-transfer doctor

clean:
	rm -rf $(VENV) build *.egg-info transfer/_native*.so
