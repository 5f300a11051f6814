# The two README commands: `make quickstart` (main job) and `make test` (whole suite).
# Both create .venv and install what they need on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
MODEL ?= smollm2-135m-instruct
NBVAL := --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg

.PHONY: install quickstart test lint notebooks clean-venv lab

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# CPU build of PyTorch (a bare `torch` would pull a multi-GB CUDA build)
	$(BIN)/python -m pip install -q "torch==2.13.*"
	$(BIN)/python -m pip install -q -e ".[dev]"
	$(BIN)/python -m ipykernel install --sys-prefix --name kakeya_lab --display-name kakeya_lab
	touch $@

quickstart: install
	$(BIN)/kakeya-lab models pull $(MODEL)
	$(BIN)/kakeya-lab run notebooks/00_quickstart.ipynb --experiment quickstart $(ARGS)

test: install
	$(BIN)/kakeya-lab models pull $(MODEL)
	$(BIN)/ruff check kakeya_lab tests
	$(BIN)/python -m pytest tests notebooks $(NBVAL) $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check kakeya_lab tests

# Re-execute the committed notebooks in place (after changing them or the package).
notebooks: install
	cd notebooks && for nb in *.ipynb; do ../$(BIN)/papermill "$$nb" "$$nb" --cwd . || exit 1; done

clean-venv:
	rm -rf $(VENV)

# JupyterLab on the notebooks, in this project's .venv, with the project's kernel
# (`kakeya_lab`, which every committed notebook names). Local only: bound to 127.0.0.1.
lab: install
	$(BIN)/python -m pip install -q -e ".[lab]"
	$(BIN)/python -m ipykernel install --sys-prefix --name kakeya_lab --display-name kakeya_lab
	$(BIN)/jupyter lab --ip=127.0.0.1 --ServerApp.root_dir=notebooks $(LAB_ARGS)
