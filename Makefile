# Set-up and entry points. Each target installs what it needs first:
#   make quickstart   venv + package (+ Fashion-MNIST, jemalloc from Debian when root), then train
#   make test         venv + package with test extras (+ Fashion-MNIST when root), then the tests
#                     (TEST_WORKERS=N pytest workers, default 3)
#   make lint         ruff and the yapf format check (settings in pyproject.toml), as .ci/run does
#   make format       yapf rewrites the tree in the house style (settings in pyproject.toml)
# PYTHON=python3.X makes the venv with another interpreter (default python3; setup.py says which);
# VENV=DIR puts it elsewhere (default .venv).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
FASHION_MNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz

.PHONY: quickstart test lint format fashion-mnist jemalloc

# Before the venv is made: PYTHON must satisfy setup.py's python_requires, both ends (pip's own refusal
# came after the venv was made, and every later make reused that venv of the old Python, even
# with PYTHON=python3.11), and a venv of another Python is made again.
PYTHON_VERSION := import sys; print(sys.version_info[:2])
CHECK_PYTHON := import re, sys; spec = re.search(r"python_requires=.([^\"]*)", open("setup.py").read())[1]; low = tuple(int(v) for v in re.search(r">=(\d+)\.(\d+)", spec).groups()); below = re.search(r"<(\d+)\.(\d+)", spec); newest = below and (int(below[1]), int(below[2]) - 1); have = sys.version_info[:2]; span = "%d.%d to %d.%d" % (low + newest) if newest else "%d.%d or newer" % low; fit = newest if newest and have > newest else low; sys.exit(0 if low <= have and not (newest and have > newest) else "$(PYTHON) is Python %d.%d; vit_jax needs %s (setup.py): install one and run make $(strip $(MAKECMDGOALS) PYTHON=python%d.%d)" % (have + (span,) + fit))
# python -m venv makes symbolic links (lib64, bin/python): where the venv's folder takes none
# (Google Drive in Colab, SMB, FAT) it had stopped with "Operation not permitted: 'lib' -> ...".
LINK_PROBE = $(dir $(VENV)).vit_jax_link_probe
CHECK_LINKS = mkdir -p '$(dir $(VENV))' && { ln -sfn . '$(LINK_PROBE)' 2>/dev/null && rm -f '$(LINK_PROBE)' || { \
  rm -f '$(LINK_PROBE)'; echo "$(abspath $(dir $(VENV))) takes no symbolic links, which a venv needs (Google Drive, SMB and FAT folders refuse them): run make $(strip $(MAKECMDGOALS)) VENV=DIR with DIR on a local disk (the workdirs may stay here)"; exit 1; }; }
# setuptools warns, in a box, that folders named like the package in the working directory
# may take precedence on import: here ./vit_jax IS the package, so its warning is silenced.
$(VENV)/installed: setup.py constraints.txt
	@$(PYTHON) -c '$(CHECK_PYTHON)'
	@$(CHECK_LINKS)
	@if [ -d $(VENV) ] && [ "$$($(PY) -c '$(PYTHON_VERSION)' 2>&1)" != "$$($(PYTHON) -c '$(PYTHON_VERSION)')" ]; then \
	  echo "$(VENV) was made with another Python: made again with $(PYTHON)"; rm -rf $(VENV); \
	fi
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	PYTHONWARNINGS='ignore:Editable installation' $(PY) -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $@

# Required by the quickstart, and by the tests that run the CLI as a user does (test_faults.py).
fashion-mnist:
	@if [ ! -f $(FASHION_MNIST) ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist; \
	  else \
	    echo "Fashion-MNIST is missing: sudo apt-get install dataset-fashion-mnist"; exit 1; \
	  fi; \
	fi

# Optional: vit-train preloads jemalloc where it is installed, so that each CPU step reuses
# its memory instead of faulting it in again (why and how much: vit_jax/host_allocator.py).
# Installed when root on a Debian-like host; anywhere else, or where apt-get fails, the run
# goes on with the C library's malloc. The install is tried before `apt-get update`, which
# the dataset's install has usually just run.
JEMALLOC_INSTALL := apt-get install -y -qq libjemalloc2 >/dev/null 2>&1
jemalloc:
	@if command -v dpkg >/dev/null && ! dpkg -s libjemalloc2 >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    if $(JEMALLOC_INSTALL) || { apt-get update -qq >/dev/null 2>&1 && $(JEMALLOC_INSTALL); }; then \
	      echo "installed libjemalloc2: vit-train runs on jemalloc"; \
	    else \
	      echo "libjemalloc2 not installed (apt-get failed): vit-train runs on glibc's malloc"; \
	    fi; \
	  else \
	    echo "tip: sudo apt-get install libjemalloc2 speeds up CPU training (vit_jax/host_allocator.py)"; \
	  fi; \
	fi

quickstart: $(VENV)/installed fashion-mnist jemalloc
	$(VENV)/bin/vit-train --config=quickstart --workdir=workdirs/quickstart

# Three pytest workers on 2 cores: much of a test's time is one-threaded (XLA's compiles,
# Python start-ups of the CLI runs), so a third worker fills the idle core. Fresh-clone runs
# on a 2-core host: 2,011 s with three, 2,368 s with two (1,904-2,286 s in earlier runs),
# 2,928 s in one process; memory in use peaked at 11.5 of 23 GiB with three.
TEST_WORKERS ?= 3
test: $(VENV)/installed fashion-mnist
	$(PY) -m pytest -q -n $(TEST_WORKERS)

lint: $(VENV)/installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/yapf --diff --recursive --parallel .

format: $(VENV)/installed
	$(VENV)/bin/yapf --in-place --recursive --parallel .
