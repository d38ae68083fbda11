# Two commands from a fresh clone:
#   make app        set up, then open the gallery on the packaged SmolLM2 at http://127.0.0.1:5006
#   make test       set up (with chromium for the browser tests), then run the whole test suite
#   make test-fast  the unit and fast integration tests (no browser), in a couple of minutes
.PHONY: app test test-fast setup setup-test bench clean-venv

PORT ?= 5006
MODEL ?= smollm2-135m
PYTEST_ARGS ?=
# parallel test workers (pytest-xdist), whole files each, costliest first (tests/README.md)
WORKERS ?= 2
PARALLEL = -n $(WORKERS) --dist loadfile --no-loadscope-reorder

setup:
	./scripts/setup.sh

setup-test:
	./scripts/setup.sh --browser

app: setup
	.venv/bin/explorer serve --model $(MODEL) --port $(PORT) --show

test: setup-test
	EXPLORER_REQUIRE_BROWSER=1 .venv/bin/python -m pytest -q -ra $(PARALLEL) --durations=25 $(PYTEST_ARGS)

test-fast: setup
	.venv/bin/python -m pytest -q -ra $(PARALLEL) --durations=10 -m "not browser and not slow" $(PYTEST_ARGS)

bench: setup
	.venv/bin/explorer bench trace-overhead --json
	.venv/bin/explorer bench slider --json

clean-venv:
	rm -rf .venv
