# specd: the README's two commands do all set-up themselves.
#   make demo   build the tiny zoo if missing, generate from the tiny target, then start the services
#               (Redis, a D3D drafter, a verifier, a plain verifier) and stream a chat completion
#               through the OpenAI-compatible HTTP API: tau, hit rate and tokens/s vs plain decoding
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

demo: zoo
	$(BIN)/specd zoo list
	$(BIN)/specd generate --model "$$($(BIN)/specd zoo path qwen3-tiny)" \
	  --prompt "def parse_header(line):" --max-tokens 48
	$(BIN)/specd up --demo

# Regenerate specd/_proto/v1 from proto/specd/v1 (a test fails when the checked-in stubs are stale).
proto: $(VENV)/.installed
	$(BIN)/python proto/generate.py

# The zoo is built first (cached; progress bars on the terminal), then the suite runs.
# pytest exits 5 when it collected no test: that is a broken suite, not a pass.
test: zoo
	@$(BIN)/python -m pytest -q $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
