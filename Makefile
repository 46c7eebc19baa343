# Two entry points (see README.md): `make run` and `make test`. Both create .venv on
# first use and install the pinned versions from constraints.txt into it.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml agent/requirements.txt platform/requirements.txt constraints.txt | cksum | cut -d' ' -f1)
DEMO_MODEL := platform/demo-model
PROMPT ?= In Python, a dictionary
TOKENS ?= 48
WORKERS ?= 8
PORT ?= 8000
AGENTS ?= 10

.PHONY: run runtime test check lint docs install bench clean chromium nginx postgresql prod-check lock demo-model gpu-check gpu-wheels loadavg

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
	PYTHONPATH=.:platform $(VENV)/bin/lint-imports
	$(PY) manage.py check
	$(PY) manage.py makemigrations --check --dry-run

# The docs site (mkdocs.yml): the committed benchmark pages checked against benchmarks/results/ (a build
# never edits a tracked file: python -m benchmarks.render_docs writes them), then a strict build into var/site/.
docs: $(STAMP)
	$(PY) -m benchmarks.render_docs --check
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet -d var/site

# The browser tests drive Debian's Chromium; install it where it is missing (needs root or sudo).
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "installing Debian's chromium for the browser tests"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -q >/dev/null && $$SUDO apt-get install -y -q chromium chromium-driver >/dev/null; } || \
	  { echo "error: could not install chromium; install the Debian packages chromium and chromium-driver" >&2; exit 1; }; }

# The production check needs Debian's nginx as its TLS proxy; install it where it is missing (needs root or sudo).
nginx:
	@command -v nginx >/dev/null 2>&1 || test -x /usr/sbin/nginx || { \
	  echo "installing Debian's nginx for the production check"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get install -y -q nginx >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -q >/dev/null && $$SUDO apt-get install -y -q nginx >/dev/null; } || \
	  { echo "error: could not install nginx; install the Debian package nginx" >&2; exit 1; }; }

# The production check puts its database on the PostgreSQL at 127.0.0.1:5432, or where none answers
# there on a private server of its own: install Debian's postgresql where neither can be (root or sudo).
postgresql:
	@pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || { \
	  echo "installing Debian's postgresql for the production check"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get install -y -q postgresql >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -q >/dev/null && $$SUDO apt-get install -y -q postgresql >/dev/null; } || \
	  { echo "error: could not install postgresql; install the Debian package postgresql" >&2; exit 1; }; }

# The production path of deploy/ on this machine, without systemd (deploy/prodcheck.py, about 2 minutes):
# PostgreSQL at 127.0.0.1:5432 or a private one (ODMOE_PRODCHECK_POSTGRES), Redis with a password, nginx with TLS, 2 web
# workers, Celery on both queues and beat, 3 agents by the one-liner, a chat (in Chromium too, across a restart of
# every web worker), a job and an OpenAI call.
prod-check: $(STAMP) chromium nginx postgresql
	$(PY) -m deploy.prodcheck

# The hash-locked requirement files (deploy/requirements.lock, agent/requirements.lock) from constraints.txt.
lock: $(STAMP)
	$(PY) deploy/lock.py

# A developer's loop (under 3 minutes on this 2-core machine): lint, then the fast tier, every test
# not marked slow, which holds a cover of each token-identity matrix on in-process clusters.
# `make test` runs every test, the slow ones included, and the docs and the production check.
# pytest runs on TEST_WORKERS pytest-xdist workers, a whole test file to one worker (module
# fixtures built once; each worker has its own test database, Redis and ports, tests/conftest.py;
# a test marked `alone`, one that times itself, runs while no other test does), dealt out longest file
# first (tests/durations.json, from a whole run: `python -m tests.durations JUNIT_XML`). Two by default:
# on this 2-core machine they take about a quarter off a fresh clone's `make test`
# (benchmarks/results/suite-test-*.json). TEST_WORKERS=0 runs them one at a time.
TEST_WORKERS ?= 2

# The machine's load average as a run of the suite begins, its first line: a run beside other work is
# slower, and benchmarks/suite.py records this line from the log of a run made by hand.
loadavg:
	@echo "load average before: $$(cut -d' ' -f1-3 /proc/loadavg)"

check: loadavg lint
	$(PY) -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=10

test: loadavg lint chromium nginx postgresql
	$(MAKE) docs
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
	$(PY) -m deploy.prodcheck

# Train the shipped demo model again (about 13 minutes on 2 cores; needs Debian's python3.11-doc).
demo-model: $(STAMP)
	$(PY) -m inference train-demo $(DEMO_MODEL)

bench: $(STAMP)
	$(PY) -m benchmarks.decode

# The GPU check (benchmarks/gpu.py, < 8 minutes on one H200): device facts, copy GB/s, one expert's
# compute, and a 4-layer Mixtral-8x7B-shaped bf16 model served with every strategy, into
# benchmarks/results/gpu.{json,md}. On a lent GPU machine, which lacks pyzmq and has transformers 5.17,
# fetch the wheels here with `make gpu-wheels`, then use the device tool's run with
# carry ["var/gpu-wheels"], timeout_s 480 and the command:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site var/gpu-wheels/*.whl && export PYTHONPATH=/tmp/site:. || exit; set -o pipefail; PYTHONUNBUFFERED=1 python3 -m benchmarks.gpu --json $OUT/gpu.json 2>&1 | tee $OUT/gpu.log
GPU_WHEELS := var/gpu-wheels
gpu-check: $(STAMP)
	PYTHONUNBUFFERED=1 $(PY) -m benchmarks.gpu --json benchmarks/results/gpu-$$(date -u +%Y-%m-%dT%H%M%S).json

gpu-wheels: $(STAMP)
	rm -rf $(GPU_WHEELS)
	$(PY) -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
	  --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
	  --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d $(GPU_WHEELS) \
	  $$(grep -iE '^(pyzmq|transformers)==' constraints.txt)
	@du -ch $(GPU_WHEELS)/*.whl

clean:
	rm -rf $(VENV) var .pytest_cache .ruff_cache
