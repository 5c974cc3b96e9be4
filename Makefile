# Set-up and entry points. Each target installs what it needs first:
#   make quickstart   venv + package (+ Fashion-MNIST from Debian when root), then train
#   make test         venv + package with test extras, then the default test suite
#   make lint         ruff and the yapf format check (settings in pyproject.toml), as .ci/run does
#   make format       yapf rewrites the tree in the house style (settings in pyproject.toml)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
FASHION_MNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz

.PHONY: quickstart test lint format fashion-mnist

$(VENV)/installed: setup.py constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $@

fashion-mnist:
	@if [ ! -f $(FASHION_MNIST) ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist; \
	  else \
	    echo "Fashion-MNIST is missing: sudo apt-get install dataset-fashion-mnist"; exit 1; \
	  fi; \
	fi

quickstart: $(VENV)/installed fashion-mnist
	$(VENV)/bin/vit-train --config=quickstart --workdir=workdirs/quickstart

test: $(VENV)/installed
	$(PY) -m pytest -q

lint: $(VENV)/installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/yapf --diff --recursive --parallel .

format: $(VENV)/installed
	$(VENV)/bin/yapf --in-place --recursive --parallel .
