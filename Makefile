# Set-up is part of every target: `make demo` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints-cpu.txt | cksum | cut -d' ' -f1)

.PHONY: demo test test-slow bench lint format clean

$(STAMP): pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints-cpu.txt -e '.[torch,server,ray,dev]'
	rm -f $(VENV)/.installed-*
	touch $@

demo: $(STAMP)
	$(VENV)/bin/icefloe demo

test: $(STAMP)
	$(PY) -m pytest -q -m 'not slow'

# The whole-demo runs and the fault suite (tens of seconds each); CI runs them after `make test`.
test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

bench: $(STAMP)
	for name in engine weight_sync wire service remote ray; do $(PY) -m bench $$name || exit 1; done

lint: $(STAMP)
	$(VENV)/bin/ruff check icefloe tests bench examples
	$(VENV)/bin/ruff format --check icefloe tests bench examples

format: $(STAMP)
	$(VENV)/bin/ruff format icefloe tests bench examples
	$(VENV)/bin/ruff check --fix icefloe tests bench examples

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
