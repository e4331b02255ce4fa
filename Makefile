# `make run`: pack the bundled demo dataset offline; `make test`: lint, type check and the test suite. Both start
# from nothing: the virtual environment is built with the exact versions of constraints.txt.
# Python 3.12 (Megatron-Bridge's own minimum) for both environments, so that the second one can stand on the first
# and share its torch: pyenv's own 3.12 first (its python3.12 shim refuses while 3.12 is not a selected version),
# else python3.12, else python3 (then the second environment is built whole, with a torch of its own).
PY312 ?= $(shell p=$$(ls -d "$$(pyenv root 2>/dev/null || echo "$${PYENV_ROOT:-$$HOME/.pyenv}")"/versions/3.12*/bin/python3.12 2>/dev/null | tail -n 1); \
	if [ -x "$$p" ]; then echo "$$p"; else command -v python3.12; fi)
PY ?= $(or $(PY312),python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO := examples/demo
EXTRAS := test,media,plot,ray,storage

.PHONY: run test lint browser bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[$(EXTRAS)]'
	touch $(STAMP)

# The second test environment: Megatron-Bridge's own pins (Python 3.12, transformers <=5.12.1, tokenizers <0.23) with
# the runtime side's dependencies only, plus Megatron-Bridge's data code for the comparison tests: its wheel (pure
# Python) and qwen-vl-utils, --no-deps (its CUDA-only dependencies are left out), in a folder of their own. librosa:
# Megatron-Bridge's own `audio` extra, which transformers <=5.12's Parakeet audio features need (the reader's too).
# pyenv's own 3.12 first (its python3.12 shim refuses while 3.12 is not a selected version), else python3.12.
MB_VENV := .venv-mbridge
MB_STAMP := $(MB_VENV)/.installed
MB_TESTS := tests/test_read.py tests/test_megatron_bridge.py tests/test_mbridge_input.py tests/test_mbridge_parity.py

# It stands on .venv when both run the same Python: .venv's packages are found after its own (a .pth file), and pip
# installs here only the versions that differ (transformers, tokenizers, numpy, ...), never touching .venv: one torch
# for both (about 5 GB less).
MB_SITE = $(MB_VENV)/lib/python$(shell $(PY312) -c 'import sys; print("%d.%d" % sys.version_info[:2])')/site-packages
$(MB_STAMP): pyproject.toml constraints-mbridge.txt $(STAMP)
	$(PY312) -m venv $(MB_VENV)
	@if [ "$$($(BIN)/python -c 'import sys; print(sys.version_info[:2])')" = \
	      "$$($(MB_VENV)/bin/python -c 'import sys; print(sys.version_info[:2])')" ]; then \
		$(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))' > $(MB_SITE)/packtool-base.pth; \
		echo "$(MB_VENV) stands on $(VENV) (one torch)"; \
	else echo "$(MB_VENV) is built whole: $(VENV) runs another Python"; fi
	$(MB_VENV)/bin/pip install -q --upgrade pip
	$(MB_VENV)/bin/pip install -q -c constraints-mbridge.txt -e '.[test,media]' librosa
	$(MB_VENV)/bin/pip install -q --no-deps --target $(MB_VENV)/mbridge megatron-bridge==0.6.2 qwen-vl-utils==0.0.14
	touch $(MB_STAMP)

# decord (Megatron-Bridge's video decoder for encoded videos, --no-deps: numpy is there) beside the wheel, for the
# Nemotron Omni parity test's encoded videos (a target of its own: an environment made before it gets it too).
MB_DECORD := $(MB_VENV)/mbridge/decord/__init__.py
# decord has x86-64 wheels only: where it does not install, those comparisons skip and say why.
$(MB_DECORD): $(MB_STAMP)
	$(MB_VENV)/bin/pip install -q --no-deps --target $(MB_VENV)/mbridge decord==0.6.0 && touch $@ || \
		echo "decord could not be installed here; the Nemotron Omni encoded-video comparisons skip"

# megatron-core and the few pure-Python packages Megatron-Bridge's configuration module imports (--no-deps, in a
# folder of their own), for the test that runs Megatron-Bridge's own `ConfigContainer.validate()` on the recipe.
MB_MCORE := $(MB_VENV)/mcore/megatron/core/__init__.py
$(MB_MCORE): $(MB_STAMP)
	$(MB_VENV)/bin/pip install -q --no-deps --target $(MB_VENV)/mcore -c constraints-mbridge.txt megatron-core \
		omegaconf antlr4-python3-runtime einops datasets dill multiprocess xxhash pandas
	touch $@

# A real 151k-rank vocabulary for the integration test (Qwen2's BPE ranks ship in this wheel): fetched for the
# tests only (`make run` does not need it), never while tests run.
TEST_STAMP := $(VENV)/.test-data
$(TEST_STAMP): $(STAMP)
	$(BIN)/pip download -q --no-deps qwen-agent==0.0.34 -d $(VENV)/wheels
	touch $(TEST_STAMP)

# The Nemotron Omni demo (audio, video, images) packs too; `make run OMNI_DEMO=0` skips it.
OMNI_DEMO ?= 1

$(DEMO)/.built: $(STAMP) examples/demo.py examples/nemotron_omni_model.py examples/tiny_model.py
	$(BIN)/python examples/demo.py $(DEMO)
	$(BIN)/python examples/nemotron_omni_model.py $(DEMO)/nemotron-omni
	$(BIN)/python examples/tiny_model.py $(DEMO)/tokenizer $(DEMO)/model
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

# The HTML report test opens the report in a real headless browser: Debian's chromium. `make browser` installs it
# system-wide when missing (as root, or through passwordless sudo), only when asked: `make test` installs nothing
# outside the tree, and without chromium that test skips and says how to get it. CI asks for it (.ci/run).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo -n)
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
		{ $(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q \
		  --no-install-recommends chromium; } || echo "chromium could not be installed; the HTML report test skips"

# Lint runs while the second environment installs (both need .venv first): about a minute less from nothing.
test:
	$(MAKE) --no-print-directory -j2 lint $(MB_STAMP) $(MB_DECORD) $(MB_MCORE) $(TEST_STAMP)
	$(BIN)/python -m pytest -q -n 2 tests
	$(MB_VENV)/bin/python -m pytest -q -n 2 $(MB_TESTS)

# Quick runs of every benchmark (each prints its numbers); see bench/*.py --help for full-size runs.
bench: $(STAMP)
	$(BIN)/pip install -q -c constraints.txt -e '.[$(EXTRAS),bench]'
	$(BIN)/python bench/bench_plan.py --sizes 100000
	$(BIN)/python bench/bench_pack.py --samples 4000
	$(BIN)/python bench/bench_read.py
	$(BIN)/python bench/bench_workers.py --samples 4000 --per-shard 1000 --repeat 1
	$(BIN)/python bench/bench_media.py
	$(BIN)/python bench/bench_video_workers.py --videos 60
	$(BIN)/python bench/bench_memory.py --samples 20000

clean:
	rm -rf $(VENV) $(MB_VENV) $(DEMO)
