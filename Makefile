# Two entry points for a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# `make run CONFIG=path/to/config.toml`; empty: the embedded defaults.
CONFIG ?=

.PHONY: run test test-fast typecheck bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

run: $(VENV)/.installed
	$(VENV)/bin/sessiond run$(if $(CONFIG), --config "$(CONFIG)")

test: $(VENV)/.installed
	$(PY) -m pytest -q

# The pure, protocol and component tiers: no daemon, no child processes.
test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -m "not process"

typecheck: $(VENV)/.installed
	$(PY) -m mypy

BENCHES := spawn ipc memory limits restart persist agent hostile load fsync_batch idle

bench: $(VENV)/.installed
	for b in $(BENCHES); do $(PY) bench/$$b.py || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache
