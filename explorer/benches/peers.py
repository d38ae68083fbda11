"""Peers the benches compare against, loaded on the same weights as the explorer's model."""
from __future__ import annotations

import copy
import shutil
import tempfile
from typing import Any

__all__ = ["transformer_lens_bridge"]


def transformer_lens_bridge(model: Any) -> tuple[Any, str | None]:
    """TransformerLens's TransformerBridge around a copy of ``model``'s weights, or None and
    the reason it is unavailable (not installed, or the model not loadable by it)."""
    try:
        from transformer_lens.model_bridge import TransformerBridge
    except ImportError as e:
        return None, f"transformer_lens unavailable: {e}"
    folder = tempfile.mkdtemp(prefix="explorer-bench-")
    try:
        hf = copy.deepcopy(model.hf)          # the bridge rewires the modules it is given
        hf.save_pretrained(folder)            # config + tokenizer for the bridge to read
        model.tokenizer.save_pretrained(folder)
        bridge = TransformerBridge.boot_transformers(folder, hf_model=hf, device="cpu",
                                                     dtype=next(hf.parameters()).dtype)
        bridge.eval()
    except Exception as e:  # noqa: BLE001 - a failing optional peer is reported, not raised
        return None, f"transformer_lens could not load the model: {type(e).__name__}: {e}"[:300]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return bridge, None
