# The two set-up commands of the README: `make demo` (install + main job) and `make test`
# (install + test suite). Both are idempotent and install into ./.venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Use a local wheel directory when the machine has one (it holds the CPU torch build).
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
PIP := $(BIN)/python -m pip install -q $(FIND_LINKS) -c constraints.txt

.PHONY: install demo test data browser capture lint check-arm64

$(BIN)/python:
	$(PY) -m venv $(VENV)

install: $(BIN)/python
	$(PIP) -e ".[torch,test,plot,dev,ray,dashboard,trace]"

# Fashion-MNIST from Debian's package, when apt is there and the files are not.
data:
	@test -d /usr/share/datasets/fashion-mnist || \
	  (command -v apt-get >/dev/null && (apt-get install -y dataset-fashion-mnist || \
	   (apt-get update && apt-get install -y dataset-fashion-mnist))) || \
	  echo "note: Fashion-MNIST not installed; pass --data-dir or see docs"

# Chromium and its driver for the dashboard's browser test, when apt is there and they are not.
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  (command -v apt-get >/dev/null && (apt-get install -y chromium chromium-driver || \
	   (apt-get update && apt-get install -y chromium chromium-driver))) || \
	  echo "note: chromium not installed; the dashboard's browser test will be skipped"

# tshark and tcpdump for the dissector's capture test, when apt is there and they are not.
capture:
	@command -v tshark >/dev/null && command -v tcpdump >/dev/null || \
	  (command -v apt-get >/dev/null && (DEBIAN_FRONTEND=noninteractive apt-get install -y \
	   tshark tcpdump || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y \
	   tshark tcpdump))) || echo "note: tshark not installed; the dissector's test will be skipped"

demo: install data
	$(BIN)/minips local --preset demo --trace

# Lint first (ruff + mypy, seconds): CI runs `make test`, so it runs the lint too.
test: install data browser capture lint
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup

lint: install
	$(BIN)/ruff check minips tests scripts examples
	$(BIN)/mypy minips tests

# The edge path on arm64: a Debian arm64 root under qemu-user-static (root; Debian's archive and
# PyPI; minutes, the root is kept in ~/.cache/minips-arm64). Not part of `make test`.
check-arm64: install
	$(BIN)/python scripts/check_arm64.py
