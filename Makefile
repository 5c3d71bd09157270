# Every target creates .venv on first use; nothing else needs to be installed by hand.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo demo-cluster test lint fuzz soak bench clean

$(STAMP): pyproject.toml omni_async/transport/_native.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

demo-cluster: $(STAMP)
	$(VENV)/bin/omni-async demo-cluster

# Four workers on two cores, a file's tests together: most of the suite's time is waiting (child
# processes starting, peers timing out), so two workers left a third of the CPU idle (2026-12-03,
# 2 cores: 264 s with two workers, 173 s with four, every test passing in both); the tests that
# compare what /dev/shm holds (marked alone) run afterwards, by themselves.
TEST_WORKERS ?= 4

test: lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not alone"
	$(PY) -m pytest -q -m alone

lint: $(STAMP)
	$(VENV)/bin/ruff check omni_async tests examples bench
	$(VENV)/bin/mypy

fuzz: $(STAMP)
	HYPOTHESIS_PROFILE=fuzz $(PY) -m pytest -q --timeout 600 tests/test_wire.py tests/test_serde.py tests/test_batch.py -k fuzz

soak: $(STAMP)
	$(PY) -m tests.soak

# The bench extra (matplotlib, for the plots) and NIXL, the contender.  nixl-cu12 declares torch
# as a dependency but its Python API imports only numpy and its own bundled libraries: install it
# without dependencies, then check that what bench/nixl_peer.py imports is importable.
BENCH_STAMP := $(VENV)/.bench-installed
NIXL        ?= nixl-cu12==1.5.1

$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install --quiet -e '.[test,bench]'
	$(PY) -m pip install --quiet --no-deps '$(NIXL)'
	$(PY) -c "from nixl_cu12 import nixl_agent, nixl_agent_config"
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	mkdir -p bench/out
	$(PY) -m bench blocks --plot bench/out/blocks.svg --json > bench/out/blocks.json
	$(PY) -m bench chunks --plot bench/out/chunks.svg --json > bench/out/chunks.json
	$(PY) -m bench layers --json > bench/out/layers.json
	$(PY) -m bench idle --json > bench/out/idle.json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis bench/out
