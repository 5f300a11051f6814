# The README commands: `make quickstart` (main job), `make test` (whole suite, as CI runs
# it) and `make test-fast` (the quick loop while changing code). All create .venv and
# install what they need on first use. Any failing step fails the target, pytest's exit
# code 5 ("no tests collected") included, so nothing passes silently.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
MODEL ?= smollm2-135m-instruct
NBVAL := --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg
# The suite runs in PYTEST_WORKERS processes (pytest-xdist), a test file or notebook per
# worker at a time (a notebook's cells share one kernel, so they stay together), each
# process on one BLAS/OpenMP thread: on 2 cores the suite took 21.6 min so, 36.6 min in
# one process on two threads (servers, kernels and the browser spend time waiting). Use
# PYTEST_WORKERS=0 for a single process. The browser tests run in the same pool (their file
# on one worker): a widget rendered in JupyterLab beside a busy worker once took over two
# minutes to appear, but every wait of theirs is for a condition, bounded at 10 minutes.
# The longest files go first (tests/conftest.py), so no worker is left alone with one;
# `--no-loadscope-reorder` keeps that order (xdist would otherwise sort the files by their
# number of tests, which sent a one-test file of 80 s out among the last).
# The compiled kernels are built (once per machine, about a minute on both cores) before
# pytest starts, not by the first test that needs them while the other worker runs; so is
# the default model's `--linear auto` choice at the workers' one thread (about 30 s, once
# per machine: `kakeya-lab models kernels`), which the `default_model` fixture and the
# test servers run.
PYTEST_WORKERS ?= 2
# The few tests that run kernels on two threads (their parallel regions are OpenMP's) do so
# beside a busy worker: a thread that spins at a barrier (OpenMP's default) keeps a core the
# other worker needs while its partner waits for one. PASSIVE makes it sleep: test_exact's
# past-eviction tests beside a busy core took 36 s instead of 71 (38 CPU-s instead of 90).
# Only the tests' environment: on an idle machine spinning is faster, and benchmarks keep it.
TEST_ENV := OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
XDIST := -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder
# The CPU build of PyTorch, pinned (a bare `torch` from PyPI is a multi-GB CUDA build).
# pip must be able to see this wheel: a local wheel folder / index in pip's own config, or
# PyTorch's CPU index, e.g. `make install TORCH_INDEX=https://download.pytorch.org/whl/cpu`.
TORCH ?= torch==2.13.0+cpu
TORCH_INDEX ?=
TORCH_INDEX_ARG := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX),)

.PHONY: install quickstart test test-fast lab lint notebooks html clean-venv

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_INDEX_ARG) "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	$(BIN)/python -m ipykernel install --sys-prefix --name kakeya_lab --display-name kakeya_lab
	touch $@

quickstart: install
	$(BIN)/kakeya-lab models pull $(MODEL)
	$(BIN)/kakeya-lab run notebooks/00_quickstart.ipynb --experiment quickstart $(ARGS)

test: install
	$(BIN)/kakeya-lab models pull $(MODEL)
	$(MAKE) --no-print-directory lint
	$(BIN)/python -m kakeya_lab.native.build
	OMP_NUM_THREADS=1 $(BIN)/kakeya-lab models kernels $(MODEL)
	$(TEST_ENV) $(BIN)/python -m pytest tests notebooks $(XDIST) $(NBVAL) $(PYTEST_ARGS)

# The quick loop: lint plus every test not marked slow (no notebooks, no browser, no slow tests).
test-fast: install
	$(BIN)/kakeya-lab models pull $(MODEL)
	$(MAKE) --no-print-directory lint
	$(BIN)/python -m kakeya_lab.native.build
	OMP_NUM_THREADS=1 $(BIN)/kakeya-lab models kernels $(MODEL)
	$(TEST_ENV) $(BIN)/python -m pytest tests -m "not slow" $(XDIST) $(PYTEST_ARGS)

# Style, format and types: what pre-commit runs too (.pre-commit-config.yaml).
lint: install
	$(BIN)/ruff check kakeya_lab tests benchmarks
	$(BIN)/ruff format --check kakeya_lab tests benchmarks
	$(BIN)/mypy kakeya_lab
	$(BIN)/python -m kakeya_lab.notebook_format --check notebooks/*.ipynb

# Re-execute the committed notebooks in place (after changing them or the package).
notebooks: install
	cd notebooks && for nb in *.ipynb; do ../$(BIN)/papermill "$$nb" "$$nb" --cwd . || exit 1; done
	$(BIN)/python -m kakeya_lab.notebook_format notebooks/*.ipynb

# The notebooks as offline HTML pages in build/html/, sharing one plotly.min.js (no CDN).
html: install
	$(BIN)/python -m kakeya_lab.notebook_html --out build/html notebooks/*.ipynb

clean-venv:
	rm -rf $(VENV)

# JupyterLab on the notebooks, in this project's .venv, with the project's kernel
# (`kakeya_lab`, which every committed notebook names). Local only: bound to 127.0.0.1.
# As root (how this machine kind runs everything) Jupyter refuses to start without
# --allow-root, so it is passed then.
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root,)

lab: install
	$(BIN)/python -m pip install -q -e ".[lab]"
	$(BIN)/python -m ipykernel install --sys-prefix --name kakeya_lab --display-name kakeya_lab
	$(BIN)/jupyter lab --ip=127.0.0.1 --ServerApp.root_dir=notebooks $(ALLOW_ROOT) $(LAB_ARGS)
