# Two commands do all set-up: `make demo` and `make test`. Both create .venv if missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# On a CUDA machine: make setup VARIANT=cuda (installs fbgemm-gpu instead of fbgemm-gpu-cpu).
# The variant installed is the stamp's name, so switching VARIANT reinstalls (and removes the
# other fbgemm build: both provide the module fbgemm_gpu); `make test VARIANT=cuda` keeps it.
VARIANT ?= cpu
ifeq ($(filter $(VARIANT),cpu cuda),)
$(error VARIANT must be cpu or cuda, got '$(VARIANT)')
endif
FBGEMM_OF_cpu := fbgemm-gpu-cpu
FBGEMM_OF_cuda := fbgemm-gpu
OTHER_VARIANT := $(if $(filter cpu,$(VARIANT)),cuda,cpu)
STAMP := $(VENV)/.installed-$(VARIANT)

.PHONY: setup test demo docs bench results clean

setup: $(STAMP)

# The stamp depends on pyproject.toml, so editing dependencies reinstalls; otherwise
# `make setup` is a no-op (fast when already done).
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	rm -f $(VENV)/.installed $(VENV)/.installed-*
	$(PIP) install -q --upgrade pip
	# torch first, pinned, so nothing later pulls a CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) uninstall -q -y $(FBGEMM_OF_$(OTHER_VARIANT))
	$(PIP) install -q -e '.[test,$(VARIANT)]'
	# torchrec requires the CUDA `fbgemm-gpu` name; its real deps are in pyproject.toml.
	$(PIP) install -q --no-deps torchrec==1.8.0
	touch $(STAMP)

# Both cores (CI has 2): pytest-xdist, tests dealt one by one except the modules marked
# xdist_group (a shared cluster or trained runs), which stay on one worker.
test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	# the documentation site: built with --strict (a broken link or a reference that does not
	# generate fails the build); tests/test_docs.py checks what the build cannot
	$(VENV)/bin/mkdocs build --strict -q
	# --durations: the slowest tests in every log, to keep the suite inside CI's time.
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=20 tests

# The documentation site, from docs/ (mkdocs.yml): build/site/index.html. The API, command-line and
# config references are generated from the code (docs/hooks.py, mkdocstrings).
docs: setup
	$(VENV)/bin/mkdocs build --strict
	@echo "== build/site/index.html"

# A run directory is never written twice (docs/DESIGN.md §1): each demo trains into a new one.
DEMO_RUN = runs/quickstart-$(shell date +%Y%m%d-%H%M%S)

demo: setup
	$(eval RUN := $(DEMO_RUN))
	$(VENV)/bin/widedp train --config configs/quickstart.toml --run-dir $(RUN) > /dev/null
	@echo "== $(RUN)/summary.json"
	@$(PY) -m json.tool $(RUN)/summary.json

# Every benchmark (full: hours on 2 cores; `make bench QUICK=1`: minutes), then `make results`.
bench: setup
	$(PY) benchmarks/run_all.py $(if $(QUICK),--quick,)

# docs/RESULTS.md and docs/plots/*.png from benchmarks/results/*.json (nothing typed by hand).
results: setup
	$(PY) benchmarks/make_results.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
