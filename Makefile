# `make run`: pack the bundled demo dataset offline; `make test`: lint, type check and the test suite. Both start
# from nothing: the virtual environment is built with the exact versions of constraints.txt.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO := examples/demo
EXTRAS := test,media,plot,ray

.PHONY: run test lint bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[$(EXTRAS)]'
	touch $(STAMP)

# A real 151k-rank vocabulary for the integration test (Qwen2's BPE ranks ship in this wheel): fetched for the
# tests only (`make run` does not need it), never while tests run.
TEST_STAMP := $(VENV)/.test-data
$(TEST_STAMP): $(STAMP)
	$(BIN)/pip download -q --no-deps qwen-agent==0.0.34 -d $(VENV)/wheels
	touch $(TEST_STAMP)

# The Nemotron Omni demo (audio, video, images) packs too; `make run OMNI_DEMO=0` skips it.
OMNI_DEMO ?= 1

$(DEMO)/.built: $(STAMP) examples/demo.py examples/nemotron_omni_model.py
	$(BIN)/python examples/demo.py $(DEMO)
	$(BIN)/python examples/nemotron_omni_model.py $(DEMO)/nemotron-omni
	touch $@

# Text, images and videos (mp4, webm, mkv, frame lists) for the Qwen2.5-VL-style folder; then audio, video and
# images for the Nemotron Omni folder into a second output (4,096 tokens: its largest sample takes about 2,400).
run: $(DEMO)/.built
	$(BIN)/packtool pack $(DEMO)/dataset $(DEMO)/packed --tokenizer $(DEMO)/tokenizer --pack-size 2048
	$(BIN)/packtool stats $(DEMO)/packed
ifeq ($(OMNI_DEMO),1)
	$(BIN)/packtool pack $(DEMO)/omni $(DEMO)/packed-omni --tokenizer $(DEMO)/nemotron-omni --pack-size 4096
	$(BIN)/packtool stats $(DEMO)/packed-omni
endif

lint: $(STAMP)
	$(BIN)/ruff check packtool tests bench scripts examples
	$(BIN)/mypy

test: lint $(TEST_STAMP)
	$(BIN)/python -m pytest -q -n 2 tests

# Quick runs of every benchmark (each prints its numbers); see bench/*.py --help for full-size runs.
bench: $(STAMP)
	$(BIN)/pip install -q -c constraints.txt -e '.[$(EXTRAS),bench]'
	$(BIN)/python bench/bench_plan.py --sizes 100000
	$(BIN)/python bench/bench_pack.py --samples 4000
	$(BIN)/python bench/bench_read.py
	$(BIN)/python bench/bench_workers.py --samples 4000 --per-shard 1000 --repeat 1
	$(BIN)/python bench/bench_media.py
	$(BIN)/python bench/bench_memory.py --samples 20000

clean:
	rm -rf $(VENV) $(DEMO)
