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

.PHONY: setup demo test test-unit test-live asan bench doctor clean

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

# The C core built with AddressSanitizer and UndefinedBehaviorSanitizer, and the tests that reach it run
# against that build (Python itself is not instrumented, so the runtimes are preloaded); the normal
# build is put back afterwards, whatever the tests said. `make asan ASAN_TESTS=...` picks the tests.
ASAN_TESTS ?= tests/unit/test_native.py tests/unit/test_native_floor.py tests/unit/test_native_init.py \
	tests/unit/test_send_frames.py tests/unit/test_wire_engine.py tests/live/test_native_sanitized.py \
	tests/live/test_native_signals.py tests/live/test_native_zmq.py tests/live/test_wire_frames.py \
	tests/live/test_wire_hostile.py tests/live/test_wire_listener_bounds.py tests/live/test_wire_listener_threads.py \
	tests/live/test_engine_direct_calls.py tests/unit/test_lane.py tests/live/test_lane_intake.py \
	tests/unit/test_native_ask.py tests/unit/test_send_ask.py tests/live/test_ask_intake.py tests/live/test_encode_request_rounds.py
SANITIZE := -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g

asan: $(STAMP)
	CFLAGS="$(SANITIZE)" LDFLAGS="$(SANITIZE)" $(PY) setup.py -q build_ext --inplace --force -t build/asan
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1 UBSAN_OPTIONS=print_stacktrace=1 \
	$(PY) -m pytest -q -ra -p no:cacheprovider $(ASAN_TESTS); \
	rc=$$?; $(PY) setup.py -q build_ext --inplace --force -t build/normal; exit $$rc

bench: $(STAMP)
	$(VENV)/bin/epd-transfer bench --quick

doctor: $(STAMP)
	$(VENV)/bin/epd-transfer doctor

clean:
	rm -rf $(VENV) build *.egg-info transfer/_native*.so
