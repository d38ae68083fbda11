# Two commands from a fresh clone:
#   make app        set up, then open the gallery on the packaged SmolLM2 at http://127.0.0.1:5006
#   make test       set up (with chromium for the browser tests), then run the whole test suite
# and:
#   make test-fast  the unit and fast integration tests (no browser)
#   make lab        set up, then open JupyterLab on examples/ at http://127.0.0.1:8888 (MODEL=
#                   picks the notebooks' model, e.g. MODEL=tiny-llama)
.PHONY: app lab test test-fast setup setup-test bench clean-venv

# Python keeps the byte code of what it imports (.venv and the tree's __pycache__/, both
# ignored by git): with PYTHONDONTWRITEBYTECODE set, every process (each test worker, served
# page, notebook kernel) compiles transformers, torch and the rest again, about 5 s of one
# core each (tests/README.md)
unexport PYTHONDONTWRITEBYTECODE

PORT ?= 5006
LAB_PORT ?= 8888
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

# JupyterLab comes with the set-up (the `test` extra); the notebooks read their model from
# EXPLORER_EXAMPLE_MODEL. Jupyter prints the address with its access token.
lab: setup
	EXPLORER_EXAMPLE_MODEL=$(MODEL) .venv/bin/jupyter lab \
	  --ServerApp.ip=127.0.0.1 --ServerApp.port=$(LAB_PORT) --ServerApp.root_dir=examples \
	  $$( [ "$$(id -u)" = 0 ] && echo --allow-root )

test: setup-test
	EXPLORER_REQUIRE_BROWSER=1 .venv/bin/python -m pytest -q -ra $(PARALLEL) --durations=25 $(PYTEST_ARGS)

test-fast: setup
	.venv/bin/python -m pytest -q -ra $(PARALLEL) --durations=10 -m "not browser and not slow" $(PYTEST_ARGS)

bench: setup
	.venv/bin/explorer bench trace-overhead --json
	.venv/bin/explorer bench slider --json

clean-venv:
	rm -rf .venv
