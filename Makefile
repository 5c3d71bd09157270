# Every target creates .venv on first use; nothing else needs to be installed by hand.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo demo-cluster test lint fuzz soak bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

demo-cluster: $(STAMP)
	$(VENV)/bin/omni-async demo-cluster

test: lint
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check omni_async tests examples bench
	$(VENV)/bin/mypy

fuzz: $(STAMP)
	HYPOTHESIS_PROFILE=fuzz $(PY) -m pytest -q tests/test_wire.py tests/test_serde.py -k fuzz

soak: $(STAMP)
	$(PY) -m tests.soak

bench: $(STAMP)
	$(PY) -m bench blocks
	$(PY) -m bench chunks
	$(PY) -m bench idle

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
