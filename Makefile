# Two entry points (see README.md): `make run` and `make test`. Both create .venv on
# first use and install the pinned versions from constraints.txt into it.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | cksum | cut -d' ' -f1)
DEMO_MODEL := platform/demo-model
PROMPT ?= In Python, a dictionary
TOKENS ?= 48
WORKERS ?= 8
PORT ?= 8000
AGENTS ?= 10

.PHONY: run runtime test check lint install bench clean chromium demo-model

$(STAMP):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
	@touch $(STAMP)

install: $(STAMP)

# The main job: the control plane (private Redis unless REDIS_URL, SQLite under var/) with
# $(AGENTS) local agents on 127.0.0.1 serving the demo model; Ctrl-C stops everything.
run: $(STAMP)
	$(PY) manage.py up --port $(PORT) --agents $(AGENTS)

# The runtime alone, without the control plane: main, shadow and $(WORKERS) workers, one generation.
runtime: $(STAMP)
	$(PY) -m inference generate --model $(DEMO_MODEL) --prompt "$(PROMPT)" --max-new-tokens $(TOKENS) --workers $(WORKERS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) manage.py check
	$(PY) manage.py makemigrations --check --dry-run

# The browser tests drive Debian's Chromium; install it where it is missing (needs root or sudo).
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "installing Debian's chromium for the browser tests"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -q >/dev/null && $$SUDO apt-get install -y -q chromium chromium-driver >/dev/null; } || \
	  { echo "error: could not install chromium; install the Debian packages chromium and chromium-driver" >&2; exit 1; }; }

test: lint chromium
	$(PY) -m pytest -q

# Train the shipped demo model again (about 13 minutes on 2 cores; needs Debian's python3.11-doc).
demo-model: $(STAMP)
	$(PY) -m inference train-demo $(DEMO_MODEL)

bench: $(STAMP)
	$(PY) -m benchmarks.decode

clean:
	rm -rf $(VENV) var .pytest_cache .ruff_cache
