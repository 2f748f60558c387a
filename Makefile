# Set-up is part of every target: `make demo` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
SUM := $(shell cat pyproject.toml constraints-cpu.txt | cksum | cut -d' ' -f1)
# The demo needs only the engines (`.[torch]`); the tests install the rest on top of that.
DEMO_STAMP := $(VENV)/.demo-$(SUM)
STAMP := $(VENV)/.installed-$(SUM)
PIP := $(PY) -m pip install -q -c constraints-cpu.txt

.PHONY: demo test test-slow bench gpu-check lint format clean

$(DEMO_STAMP): pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) -e '.[torch]'
	rm -f $(VENV)/.demo-*
	touch $@

$(STAMP): $(DEMO_STAMP)
	$(PIP) -e '.[torch,server,ray,dev]'
	rm -f $(VENV)/.installed-*
	touch $@

# Each run writes a new folder: runs/demo, then runs/demo-2, ... (a failed run never blocks the next).
demo: $(DEMO_STAMP)
	$(VENV)/bin/icefloe demo

# Two workers, a test file each at a time: half the suite's time is spent waiting on services, engine
# processes and Ray actors, which the other worker's file fills (2-core machine: 218-254 s -> 162-180 s).
test: $(STAMP)
	$(PY) -m pytest -q -m 'not slow' -n 2 --dist loadfile

# tinker-cookbook for its integration test: --no-deps, since it declares tml-renderers (which PyPI
# cannot satisfy and math_rl never imports); the rest is what its math_rl recipe imports.
COOKBOOK := $(VENV)/.cookbook-0.6.1
$(COOKBOOK): $(STAMP)
	$(PY) -m pip install -q --no-deps tinker-cookbook==0.6.1 chz==0.4.0 termcolor==3.3.0 cloudpickle==3.1.3 \
		blobfile==3.3.0 pycryptodomex==3.24.2 lxml==6.1.3 tiktoken==0.14.0 pyrage==1.4.0 datasets==4.4.2 \
		dill==0.4.1 xxhash==4.1.0 multiprocess==0.70.19 aiohttp==3.14.5 aiosignal==1.4.0 aiohappyeyeballs==2.7.1 \
		frozenlist==1.8.0 multidict==7.2.1 propcache==0.5.4 yarl==1.25.1 pylatexenc==2.11 math-verify==0.9.0 \
		latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
	touch $@

# Stock verl 0.9.1 for the real verl launch test, in an environment of its own inside .venv (its
# transformers range is not icefloe's); transferqueue and cachetools are what its V1 trainer imports
# beyond verl's own requirements, the server extra its rollout server. The test runs this Python.
VERL_STAMP := $(VENV)/verl/.installed-$(SUM)
$(VERL_STAMP): $(STAMP)
	$(PYTHON) -m venv $(VENV)/verl
	$(VENV)/verl/bin/python -m pip install -q -c constraints-cpu.txt -e '.[torch,server,ray,verl]' \
		verl==0.9.1 transferqueue==0.1.11 cachetools==8.0.3
	rm -f $(VENV)/verl/.installed-*
	touch $@

# The whole-demo runs, the fault suite, the cookbook run and real verl (tens of seconds to minutes each);
# CI runs them after `make test`. Two workers as in `make test`: the demo runs on one torch thread, so
# the other core runs the next file (2-core machine: 564-618 s -> 317 s). ICEFLOE_REQUIRE_VERL: the verl
# test fails, never skips, when .venv/verl cannot run verl.
test-slow: $(STAMP) $(COOKBOOK) $(VERL_STAMP)
	ICEFLOE_REQUIRE_VERL=1 $(PY) -m pytest -q -m slow -n 2 --dist loadfile

# Every bench_*.py in bench/ (a new one too), then load's Tinker mode; tens of minutes on 2 cores.
# CI runs each in its --smoke mode (tests/bench/test_benches.py).
bench: $(STAMP)
	for name in $$($(PY) -c 'from bench.__main__ import available; print(*available())'); do \
		$(PY) -m bench $$name || exit 1; \
	done
	$(PY) -m bench load --api tinker

# Every GPU path run once on a CUDA machine (docs/gpu.md). There the Python that holds CUDA torch and
# vLLM runs it (GPU_PY=...), not this venv, whose torch is the CPU build. DRY_RUN=1: the same checks on
# CPU with the tiny model, in this venv.
GPU_PY ?= $(PY)
gpu-check: $(if $(DRY_RUN),$(STAMP))
	$(if $(DRY_RUN),$(PY),$(GPU_PY)) -m bench.gpu_check $(if $(DRY_RUN),--dry-run)

lint: $(STAMP)
	$(VENV)/bin/ruff check icefloe tests bench examples
	$(VENV)/bin/ruff format --check icefloe tests bench examples

format: $(STAMP)
	$(VENV)/bin/ruff format icefloe tests bench examples
	$(VENV)/bin/ruff check --fix icefloe tests bench examples

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
