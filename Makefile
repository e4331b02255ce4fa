# `make run`: pack the bundled demo dataset offline; `make test`: the test suite. Both start from nothing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO := examples/demo

.PHONY: run test bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

$(DEMO)/.built: $(STAMP) examples/demo.py
	$(BIN)/python examples/demo.py $(DEMO)
	touch $@

run: $(DEMO)/.built
	$(BIN)/packtool pack $(DEMO)/dataset $(DEMO)/packed --tokenizer $(DEMO)/tokenizer --pack-size 2048
	$(BIN)/packtool stats $(DEMO)/packed

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 tests

clean:
	rm -rf $(VENV) $(DEMO)
