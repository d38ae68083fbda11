"""The GPT-2-style transformer trained on the task mixture."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from explorer._checks import InputError, check_int

__all__ = ['TaskICLTransformer']


class _Block(nn.Module):
    """Pre-LayerNorm GPT-2 block: causal multi-head attention, then a GELU MLP."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln_1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp_in = nn.Linear(d_model, 4 * d_model)
        self.mlp_out = nn.Linear(4 * d_model, d_model)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, m = h.shape
        q, k, v = self.qkv(self.ln_1(h)).split(m, dim=-1)               # [batch, pos, d_model] each
        q, k, v = (a.view(b, t, self.n_heads, m // self.n_heads).transpose(1, 2) for a in (q, k, v))
        z = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, head, pos, d_head]
        h = h + self.proj(z.transpose(1, 2).reshape(b, t, m))
        return h + self.mlp_out(nn.functional.gelu(self.mlp_in(self.ln_2(h))))


class TaskICLTransformer(nn.Module):
    """A small GPT-2-style transformer reading ``(x_1, y_1), ..., (x_n, y_n), (x_q, ?)`` as tokens.

    Each example is one token ``[x_i, y_i, 0]`` and the query ``[x_q, 0, 1]`` (pairs in one
    token, as in He et al.'s linear-ICL setting: interleaving x and y tokens, as Garg et al.
    and Han et al. do, costs the model a long plateau before it links each y to its x, too
    long for a CPU budget). One linear map plus a learned position embedding, pre-LN blocks
    with causal attention, and a readout at the query token.

    Parameters
    ----------
    d : int
        Input dimension.
    n_examples : int
        Context pairs before the query (the sequence has ``n_examples + 1`` tokens).
    n_layers, d_model, n_heads : int
    seed : int, default=0
        Seed of the initialisation (normal, std 0.02, zero biases, as GPT-2).
    """

    def __init__(self, d: int, n_examples: int, *, n_layers: int = 4, d_model: int = 64,
                 n_heads: int = 4, seed: int = 0) -> None:
        super().__init__()
        d = check_int("d", d, low=1, high=1024)
        n_examples = check_int("n_examples", n_examples, low=1, high=512)
        check_int("n_layers", n_layers, low=1, high=48)
        check_int("d_model", d_model, low=1, high=4096)
        check_int("n_heads", n_heads, low=1, high=d_model)
        if d_model % n_heads:
            raise InputError(f"`d_model` ({d_model}) must be a multiple of `n_heads`; got {n_heads}.")
        self.d, self.n_examples = d, n_examples
        self.read_in = nn.Linear(d + 2, d_model)
        self.pos = nn.Parameter(torch.zeros(n_examples + 1, d_model))
        self.blocks = nn.ModuleList(_Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.read_out = nn.Linear(d_model, 1)
        gen = torch.Generator().manual_seed(check_int("seed", seed))
        with torch.no_grad():
            for name, par in self.named_parameters():
                if name.endswith("bias"):
                    par.zero_()
                elif ".ln_" in name or name.startswith("ln_"):
                    par.fill_(1.0)
                else:
                    par.copy_(torch.randn(par.shape, generator=gen) * 0.02)

    @property
    def n_layers(self) -> int:
        return len(self.blocks)

    def tokens(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Pair tokens from ``x`` [prompt, n+1, d] and ``y`` [prompt, n+1]: [prompt, n+1, d+2].

        Example ``i`` is ``[x_i, y_i, 0]``; the query is ``[x_q, 0, 1]`` (its answer hidden).
        """
        p, e, d = x.shape
        tok = torch.zeros(p, e, d + 2, dtype=x.dtype)
        tok[..., :d] = x
        tok[:, :-1, d] = y[:, :-1]
        tok[:, -1, d + 1] = 1.0
        return tok

    def forward(self, x: torch.Tensor, y: torch.Tensor, *,
                residuals: bool = False) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """Prediction of the query's y: [prompt] (``y[:, -1]`` is never read).

        With ``residuals=True`` also the residual stream after every block at the query
        token: a list of ``n_layers`` tensors [prompt, d_model].
        """
        h = self.read_in(self.tokens(x, y)) + self.pos                   # [prompt, pos, d_model]
        kept = []
        for block in self.blocks:
            h = block(h)
            if residuals:
                kept.append(h[:, -1])
        pred = self.read_out(self.ln_f(h[:, -1]))[..., 0]               # [prompt]
        return (pred, kept) if residuals else pred

    def flat_weights(self) -> np.ndarray:
        return torch.cat([p.detach().flatten() for p in self.parameters()]).numpy().copy()

    def load_flat_weights(self, flat: np.ndarray) -> None:
        flat = torch.as_tensor(np.asarray(flat, dtype=np.float32))
        n = sum(p.numel() for p in self.parameters())
        if flat.numel() != n:
            raise InputError(f"the checkpoint holds {flat.numel()} weights; this model needs {n}.")
        with torch.no_grad():
            at = 0
            for p in self.parameters():
                p.copy_(flat[at:at + p.numel()].view_as(p))
                at += p.numel()
