# specd: the README's two commands do all set-up themselves.
#   make demo   build the zoo if missing, answer a chat with SmolLM2-135M, serve it and stream a chat
#               completion through the OpenAI-compatible HTTP API, then start the speculative stack on
#               the tiny zoo (Redis, a D3D drafter, a verifier, a plain verifier): tau, hit rate and
#               tokens/s vs plain decoding
#   make test   the whole test suite (unit, integration; builds and caches the zoo once)

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PYTEST_ARGS ?=

.PHONY: all setup redis demo test proto zoo clean

all: test

# The venv is rebuilt only when pyproject.toml changes. pip takes torch==2.13.0 (CPU) from the
# machine's wheel directory when pip is configured with one, and from PyPI otherwise.
$(VENV)/.installed: pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	@touch $@

setup: $(VENV)/.installed redis

# Integration tests start their own redis-server on a free port; install it where missing.
redis:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing redis-server with apt-get"; \
	  $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq redis-server >/dev/null; }

zoo: setup
	$(BIN)/specd zoo build

# The demo builds only what it shows (SmolLM2, the tiny target and its D3D drafter), not the
# hybrid targets the tests also use.
demo: setup
	$(BIN)/specd zoo build --only smollm2-135m
	$(BIN)/specd zoo build --only d3d-qwen3-tiny
	$(BIN)/specd zoo list
	$(BIN)/specd generate --model smollm2-135m --chat --max-tokens 64 \
	  --prompt "Write a Python function that parses an HTTP header line into a name and a value."
	$(BIN)/specd up --demo --prompt-lookup --mode sync
	$(BIN)/specd up --demo --target qwen3-tiny

# Regenerate specd/_proto/v1 from proto/specd/v1 (a test fails when the checked-in stubs are stale).
proto: $(VENV)/.installed
	$(BIN)/python proto/generate.py

# The zoo is built first (cached; progress bars on the terminal), then the suite runs in
# TEST_WORKERS pytest-xdist workers, a test file to a worker (its module fixtures start once), each
# on its share of torch's threads (tests/conftest.py): on 2 cores 2 workers ran the suite in 817 s
# against 1307 s in one process. One core, or TEST_WORKERS=0: in this process.
TEST_WORKERS ?= $(shell [ "$$(nproc 2>/dev/null || echo 1)" -ge 2 ] && echo 2 || echo 0)
# pytest exits 5 when it collected no test: that is a broken suite, not a pass.
test: zoo
	@$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
