"""Shared fixtures: tiny random-init models (fast) and the packaged SmolLM2 (integration)."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def _no_grad():
    torch.set_grad_enabled(False)
    yield


@pytest.fixture(scope="session")
def tiny_model():
    """A seeded random-init Llama-family model (3 layers, 4 heads, 2 KV heads, d_model 64)."""
    from explorer import load_model

    return load_model("tiny-llama")


@pytest.fixture(scope="session")
def tiny_gpt2():
    from explorer import load_model

    return load_model("tiny-gpt2")


@pytest.fixture(scope="session")
def smollm2():
    """The packaged SmolLM2-135M-Instruct (converted once into the cache folder)."""
    from explorer import load_model

    return load_model("smollm2-135m")


CHROMIUM = "/usr/bin/chromium"  # Debian's chromium; Playwright never downloads a browser here
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def browser():
    """Headless chromium driven by Playwright, one per test module."""
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()
