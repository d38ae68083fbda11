"""Plain torch hooks for the tests' independent references."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any


@contextlib.contextmanager
def removed_after(handles: Sequence[Any]) -> Iterator[Sequence[Any]]:
    """Run the block with the torch hook ``handles`` in place, then remove them (also when
    the block raises), so a failed reference leaves the shared tiny model unhooked."""
    try:
        yield handles
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def eager_attention(model: Any) -> Iterator[None]:
    """Run the block with the Hugging Face module on eager attention (the implementation that
    returns attention weights), then put back the one it had."""
    before = model.hf.config._attn_implementation
    model.hf.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.hf.set_attn_implementation(before)


def hf_attentions(model: Any, prompt: str) -> Any:
    """[layer, head, q, k] attention weights of ``prompt`` from Hugging Face's own forward
    with ``output_attentions`` (eager), as float32 numpy."""
    import torch

    ids = torch.tensor([model.tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    with eager_attention(model), torch.no_grad():
        out = model.hf(input_ids=ids, output_attentions=True)
    return torch.stack([a[0] for a in out.attentions]).float().numpy()
