"""The per-head engine: a transformer layer's forward on the model's own weights, one head at a time.

A Hugging Face forward computes all heads of a layer from one residual stream. Edge
attribution (EAP, EAP-IG), circuit patching and per-head interventions need more: each head
reading its own copy of the stream (its own input) and writing its own term of the residual
stream. `HeadEngine` computes exactly that from the weights of ``model.hf``, driven by the
family's `explorer.models.ArchSpec` (where the q/k/v, output, MLP, norm and embedding modules
are, and the family's facts: fused q/k/v layouts, grouped-query attention, biases, partial
rotary embeddings, sliding windows, attention-logit soft caps, GPT-NeoX's parallel attention
and MLP, Gemma-2's extra norms). With every head reading the same stream it reproduces the
Hugging Face logits (tested on every family's tiny model).

Head writes: head ``h`` of layer ``l`` writes ``z_h @ W_O[h]`` (its slice of the output
projection), so the writes of a layer's heads sum to the projection's output (before its
bias). Where the family normalises the attention output before it joins the residual
stream (Gemma-2's post-attention RMSNorm), the norm is a per-position scale times a gain,
and each head's write is its slice times that run's scale and gain: the writes still sum to
what reaches the stream, and a head's write depends on the other heads of its layer only
through the shared scale.

The engine calls modules through the model's module tree (``model.hf``), which is also
how it runs on a remote model's served weights (`explorer.trace.run_on_weights`): there
``model.hf`` is the server's envoy tree, so nothing here may look at a module's type.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ._checks import ExplorerError
from .lora import LoRAWeights
from .models import Batch, Model, _get_path

__all__ = ["ENGINE_FAMILIES", "UnsupportedModelError", "HeadEngine", "EngineRun",
           "check_engine_family", "parallel_attn_mlp", "causal_mask"]

ENGINE_FAMILIES = ("llama", "gpt2", "gpt_neox", "gemma2")


class UnsupportedModelError(ExplorerError, ValueError):
    """The model has no per-head forward here."""


def check_engine_family(model: Model) -> None:
    """Raise UnsupportedModelError unless the engine covers ``model`` (local or remote: only
    the module structure is read)."""
    family = model.spec.family
    if family not in ENGINE_FAMILIES or model.arch.qkv_paths is None:
        raise UnsupportedModelError(
            f"the per-head engine supports the model families {', '.join(ENGINE_FAMILIES)}; "
            f"{model.spec.name} is {family!r}.")
    attn0 = _get_path(model.hf_layer(0), model.arch.attn_path)
    if hasattr(attn0, "q_norm") or hasattr(attn0, "k_norm"):
        raise UnsupportedModelError(
            f"{model.spec.name} normalises queries and keys (Qwen3/Gemma-3 style), which the "
            f"per-head engine does not implement; supported families: "
            f"{', '.join(ENGINE_FAMILIES)} (Llama, SmolLM2, Qwen2, Mistral, GPT-2, GPT-NeoX/"
            "Pythia, Gemma-2).")
    if model.arch.attn_out_norm_path is not None and model.b_O(0) is not None:
        raise UnsupportedModelError(
            f"{model.spec.name} normalises an attention output that has a bias, which the "
            "per-head engine does not split into head writes.")


def parallel_attn_mlp(model: Model) -> bool:
    """Whether each layer's MLP reads the same residual stream as its attention (GPT-NeoX's
    parallel residual) instead of the stream after the attention's write."""
    attr = model.arch.parallel_residual_attr
    return bool(attr and getattr(model.hf.config, attr, False))


def causal_mask(batch: Batch, window: int | None = None) -> torch.Tensor:
    """[prompt, 1, q, k]: causal, keys not padding and, with ``window``, less than ``window``
    positions back (a padded query attends to itself)."""
    w = batch.width
    device = batch.attention_mask.device
    causal = torch.tril(torch.ones(w, w, dtype=torch.bool, device=device))
    if window is not None:
        causal = causal & ~torch.tril(torch.ones(w, w, dtype=torch.bool, device=device),
                                      diagonal=-window)
    keys = batch.attention_mask.bool()[:, None, None, :]
    eye = torch.eye(w, dtype=torch.bool, device=device)
    return (causal & keys) | eye


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [prompt, head, pos, d_head] (its first cos.shape[-1] dims:
    partial rotary, GPT-NeoX's rotary_pct, leaves the rest as it is)."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    x_rot, x_pass = x[..., :r], x[..., r:]
    return torch.cat([x_rot * cos + _rotate_half(x_rot) * sin, x_pass], dim=-1)


def _shared_qkv(x0: torch.Tensor, norm: Any, W_shared: torch.Tensor, b_shared: torch.Tensor | None,
                rep: torch.Tensor, n_heads: int, d_head: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query, key and value [prompt, head, pos, d_head] of every head from one input
    [prompt, pos, d_model]: normalised once, projected with the model's own q/k/v weights
    (one key/value per group, copied to its query heads)."""
    b, p, d = x0.shape
    y = torch.matmul(norm(x0), W_shared)                                # [prompt, pos, (H+2G)*d_head]
    if b_shared is not None:
        y = y + b_shared
    n_q = n_heads * d_head
    n_kv = (y.shape[-1] - n_q) // 2
    q = y[..., :n_q].view(b, p, n_heads, d_head).transpose(1, 2)        # [prompt, head, pos, d_head]
    k = y[..., n_q:n_q + n_kv].view(b, p, -1, d_head).transpose(1, 2)[:, rep]
    v = y[..., n_q + n_kv:].view(b, p, -1, d_head).transpose(1, 2)[:, rep]
    return q, k, v


class _SharedInputQKV(torch.autograd.Function):
    """Per-head query/key/value of heads that all read the SAME input (an unpatched run).

    Forward normalises the input once and projects it with the model's own q/k/v weights
    (one key/value per group under grouped-query attention, then copied to its query heads);
    backward still gives every head its own input gradient, ``J_norm^T (W_h^T d[q|k|v]_h)``,
    exactly what the per-head computation (`HeadEngine.project` on H copies) gives.
    """

    @staticmethod
    def forward(ctx, x_heads, norm, W_shared, b_shared, W_heads, rep, n_heads, d_head):
        # x_heads [head, prompt, pos, d_model] with stride 0 over head: one input read H times;
        # or [3*head, ...]: each head's query, key and value inputs (the q/k/v-split graph)
        x0 = x_heads[0]                                                 # [prompt, pos, d_model]
        ctx.save_for_backward(x0, W_heads)
        ctx.norm = norm
        ctx.split = x_heads.shape[0] == 3 * n_heads
        return _shared_qkv(x0, norm, W_shared, b_shared, rep, n_heads, d_head)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        x0, W_heads = ctx.saved_tensors                                 # W_heads [head, d_model, 3*d_head]
        H = W_heads.shape[0]
        b, p, d = x0.shape
        if ctx.split:  # each of q, k, v through its own slice of the weights: [3*head, ...]
            dh = W_heads.shape[-1] // 3
            parts = [torch.bmm(g.transpose(0, 1).reshape(H, b * p, dh),
                               W_heads[:, :, i * dh:(i + 1) * dh].transpose(1, 2))
                     for i, g in enumerate((dq, dk, dv))]
            dnormed = torch.cat(parts, dim=0).view(3 * H, b, p, d)      # [3*head, prompt, pos, d_model]
        else:
            dqkv = torch.cat([dq, dk, dv], dim=-1).transpose(0, 1).reshape(H, b * p, -1)
            dnormed = torch.bmm(dqkv, W_heads.transpose(1, 2)).view(H, b, p, d)  # [head, prompt, pos, d_model]
        _, norm_vjp = torch.func.vjp(ctx.norm, x0)
        (dx,) = torch.func.vmap(norm_vjp)(dnormed)                      # [head(s), prompt, pos, d_model]
        return dx, None, None, None, None, None, None, None


@dataclass
class EngineRun:
    """One plain run of the engine (every head reading the running stream)."""

    resid_pre: torch.Tensor  # [layer, prompt, pos, d_model]
    head_out: torch.Tensor   # [layer, head, prompt, pos, d_model], each head's write
    mlp_out: torch.Tensor    # [layer, prompt, pos, d_model], the MLP's write
    logits: torch.Tensor     # [prompt, pos, vocab]


class HeadEngine:
    """Embedding, per-head attention on per-head inputs, MLP and unembedding of one model.

    ``lora`` (`explorer.lora.LoRAWeights`) adds fine-tuning adapters without merging them
    into a copy: merged into the attention weights read here, added by hooks
    (`lora_hooks`, the caller removes them) to the modules the engine calls (the MLP's).

    Methods take and return tensors shaped as the circuit graph needs them: per-head inputs
    ``[head, prompt, pos, d_model]`` in, per-head writes ``[head, prompt, pos, d_model]`` out.
    """

    def __init__(self, model: Model, lora: LoRAWeights | None = None):
        check_engine_family(model)
        arch, spec = model.arch, model.spec
        self.model = model
        self.hf = model.hf
        self.n_layers = model.n_layers
        self.n_heads = spec.n_heads
        self.n_kv = spec.n_kv_heads
        self.d_head = spec.d_head
        self.parallel = parallel_attn_mlp(model)
        cfg = model.hf.config
        cap = getattr(cfg, arch.attn_softcap_attr, None) if arch.attn_softcap_attr else None
        self.attn_softcap = float(cap) if cap else None
        self.layers = [model.hf_layer(layer) for layer in range(model.n_layers)]
        self.lora = lora
        self.merged: set[str] = set()
        H, dh = self.n_heads, self.d_head
        self.rep = torch.arange(H) // (H // self.n_kv)  # query head -> its key/value head
        self.W, self.b, self.W_shared, self.b_shared = [], [], [], []
        self.scaling, self.windows = [], []
        for layer, block in enumerate(self.layers):
            wq, wk, wv, bq, bk, bv = self._qkv(layer)
            # [head, d_model, 3*d_head]: query, key, value of each query head side by side
            w = torch.cat([wq.reshape(H, dh, -1), wk.reshape(self.n_kv, dh, -1)[self.rep],
                           wv.reshape(self.n_kv, dh, -1)[self.rep]], dim=1)
            self.W.append(w.transpose(1, 2).contiguous())
            self.W_shared.append(torch.cat([wq, wk, wv], dim=0).T.contiguous())  # [d_model, (H+2G)*d_head]
            if bq is None:
                self.b.append(None)
                self.b_shared.append(None)
            else:
                self.b_shared.append(torch.cat([bq, bk, bv]))
                self.b.append(torch.cat([bq.reshape(H, dh), bk.reshape(self.n_kv, dh)[self.rep],
                                         bv.reshape(self.n_kv, dh)[self.rep]], dim=1))
            attn = _get_path(block, arch.attn_path)
            self.scaling.append(float(attn.scaling))
            self.windows.append(self._window(attn, cfg))
        self._W_O = [model.W_O(layer, self.weight(layer, arch.o_proj_path, model.o_proj(layer)))
                     for layer in range(model.n_layers)]  # [head, d_head, d_model]
        self._b_O = [model.b_O(layer) for layer in range(model.n_layers)]

        def sub(block: Any, path: str | None) -> Any:
            return None if path is None else _get_path(block, path)
        self.attn_norm = [sub(b, arch.attn_norm_path) for b in self.layers]
        self.mlp_norm = [sub(b, arch.mlp_norm_path) for b in self.layers]
        self.attn_out_norm = [sub(b, arch.attn_out_norm_path) for b in self.layers]
        self.mlp_out_norm = [sub(b, arch.mlp_out_norm_path) for b in self.layers]
        self.mlps = [sub(b, arch.mlp_path) for b in self.layers]

    # -- weights ---------------------------------------------------------------------------
    def weight(self, layer: int, sub: str, module: Any) -> torch.Tensor:
        """``module.weight`` (``sub`` inside layer ``layer``) plus its LoRA update, if any."""
        w = module.weight
        if self.lora is None:
            return w
        name = f"{self.model.arch.layers_path}.{layer}.{sub}"
        delta = self.lora.delta(name, w.dtype)
        if delta is None:
            return w
        self.merged.add(name)
        return w + delta

    def lora_hooks(self) -> list[Any]:
        """Hooks adding the adapters not merged into read weights (the MLP's); the caller
        removes them."""
        if self.lora is None:
            return []
        return self.lora.hooks(self.model, [n for n in self.lora.names() if n not in self.merged])

    def _qkv(self, layer: int) -> tuple[torch.Tensor, ...]:
        """Query, key and value weights [out, d_model] (Linear layout) and biases [out] or
        None, whatever the family's layout (`ArchSpec.qkv_layout`)."""
        arch = self.model.arch
        block = self.layers[layer]
        H, G, dh = self.n_heads, self.n_kv, self.d_head
        if arch.qkv_layout == "separate":
            mods = [_get_path(block, p) for p in arch.qkv_paths]
            ws = [self.weight(layer, p, m) for p, m in zip(arch.qkv_paths, mods)]
            bs = [m.bias for m in mods]
            if arch.qkv_transposed:
                ws = [w.T for w in ws]
            return (*ws, *(bs if bs[0] is not None else (None, None, None)))
        (path,) = arch.qkv_paths
        mod = _get_path(block, path)
        w = self.weight(layer, path, mod)
        w = w.T if arch.qkv_transposed else w       # [3*d_model, d_model] (or (H+2G)*d_head)
        bias = mod.bias
        if arch.qkv_layout == "blocks":              # rows: all queries | all keys | all values
            sizes = [H * dh, G * dh, G * dh]
            ws = list(torch.split(w, sizes, dim=0))
            bs = list(torch.split(bias, sizes)) if bias is not None else [None] * 3
        elif arch.qkv_layout == "per_head":          # rows: [head, q|k|v, d_head] (GPT-NeoX)
            w4 = w.reshape(H, 3, dh, -1)
            ws = [w4[:, i].reshape(H * dh, -1) for i in range(3)]
            if bias is not None:
                b3 = bias.reshape(H, 3, dh)
                bs = [b3[:, i].reshape(H * dh) for i in range(3)]
            else:
                bs = [None] * 3
        else:
            raise UnsupportedModelError(f"unknown q/k/v layout {arch.qkv_layout!r}.")
        return (*ws, *bs)

    @staticmethod
    def _window(attn: Any, cfg: Any) -> int | None:
        """Sliding window of one attention layer (None: full causal attention)."""
        if hasattr(attn, "sliding_window"):   # Qwen2, Gemma-2: set per layer
            w = attn.sliding_window
        elif getattr(cfg, "use_sliding_window", True):  # Mistral: one window for all
            w = getattr(cfg, "sliding_window", None)
        else:
            w = None
        return int(w) if w else None

    # -- the pieces of a layer --------------------------------------------------------------
    def embed(self, batch: Batch) -> torch.Tensor:
        """Input embeddings [prompt, pos, d_model] (with learned positions where the family
        has them)."""
        arch = self.model.arch
        x = _get_path(self.hf, arch.embed_path)(batch.input_ids)
        if arch.pos_embed_path is not None:
            x = x + _get_path(self.hf, arch.pos_embed_path)(batch.position_ids)
        return x

    def prepare(self, x0: torch.Tensor, batch: Batch, start: int = 0,
                stop: int | None = None,
                past: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> dict[str, Any]:
        """What every layer of this batch shares: rotary cos/sin, the causal mask
        (``ctx["mask"]``) and the sliding-window masks.

        ``start``/``stop``: a run over the positions [start, stop) only (``x0`` holds those),
        its queries reading the keys and values of [0, start) from ``past`` (per layer, what
        an earlier run over those positions recorded: `heads` appends each layer's to
        ``ctx["record"]`` when that list is present). Positions before ``start`` do not
        depend on later ones (causal attention), so the run's values are the full run's.
        """
        stop = batch.width if stop is None else stop
        if (start > 0) != (past is not None):
            raise ValueError("a run from position start > 0 reads the earlier positions' "
                             f"keys and values (past); got start={start}, past "
                             f"{'given' if past is not None else 'missing'}.")
        ctx: dict[str, Any] = {"past": past}
        rotary = self.model.arch.rotary_path
        if rotary is not None:
            cos, sin = _get_path(self.hf, rotary)(x0, batch.position_ids[:, start:stop])
            ctx["cos"], ctx["sin"] = cos.unsqueeze(1), sin.unsqueeze(1)  # [prompt, 1, pos, rot]
        ctx["mask"] = causal_mask(batch)[:, :, start:stop, :stop]     # [prompt, 1, q, k]
        windows = {w for w in self.windows if w is not None and w < stop}
        masks = {w: causal_mask(batch, w)[:, :, start:stop, :stop] for w in windows}
        ctx["masks"] = {layer: masks[w] for layer, w in enumerate(self.windows) if w in masks}
        return ctx

    @staticmethod
    def project(normed: torch.Tensor, W: torch.Tensor, bias: torch.Tensor | None,
                n_parts: int) -> list[torch.Tensor]:
        """Per-head projections: normed [head, prompt, pos, d_model], W [head, d_model, k*d_head]
        -> k tensors [prompt, head, pos, d_head]."""
        H, b, p, d = normed.shape
        y = torch.bmm(normed.reshape(H, b * p, d), W)                 # [head, prompt*pos, k*d_head]
        if bias is not None:
            y = y + bias[:, None, :]
        y = y.view(H, b, p, n_parts, -1).permute(3, 1, 0, 2, 4)        # [k, prompt, head, pos, d_head]
        return list(y.unbind(0))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
               scaling: float) -> torch.Tensor:
        """Eager attention; q, k, v [prompt, head, pos, d_head], mask [prompt, 1, q, k]."""
        scores = torch.matmul(q, k.transpose(-1, -2)) * scaling  # [prompt, head, q, k]
        if self.attn_softcap is not None:                          # Gemma-2
            scores = torch.tanh(scores / self.attn_softcap) * self.attn_softcap
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        return torch.matmul(weights, v)                            # [prompt, head, pos, d_head]

    def head_out(self, layer: int, z: torch.Tensor) -> torch.Tensor:
        """[prompt, head, pos, d_head] -> each head's write [head, prompt, pos, d_model]."""
        b, H, p, dh = z.shape
        z = z.transpose(0, 1).reshape(H, b * p, dh)
        out = torch.bmm(z, self._W_O[layer].to(z.dtype)).view(H, b, p, -1)
        norm = self.attn_out_norm[layer]
        if norm is not None:
            out = self._out_norm(norm, out.sum(0), out)
        return out

    def _out_norm(self, norm: Any, total: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """RMSNorm of the summed attention output ``total`` [prompt, pos, d_model], x *
        scale(x) * gain, applied to ``out`` (the total, or its per-head terms)."""
        total = total.float()
        eps = getattr(norm, "eps", None)
        eps = getattr(norm, "variance_epsilon", 1e-6) if eps is None else eps
        scale = torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + eps)
        gain = norm.weight.float() + self.model.arch.norm_gain_offset
        return (out.float() * (scale * gain)).to(out.dtype)

    def heads(self, layer: int, x: torch.Tensor, mask: torch.Tensor, ctx: dict) -> torch.Tensor:
        """Per-head inputs [head, prompt, pos, d_model] -> head writes [head, prompt, pos, d_model].

        ``x`` may also be [3*head, prompt, pos, d_model]: every head's query input, then every
        head's key input, then every head's value input (the q/k/v-split graph of Hanna et
        al. 2024, TransformerLens's ``use_split_qkv_input``): each is normalised on its own
        and projected by its own part of the weights. Under grouped-query attention each
        query head has its own key and value input (its own copy of its group's projection).
        """
        norm = self.attn_norm[layer]
        H, dh = self.n_heads, self.d_head
        if x.shape[0] not in (H, 3 * H):
            raise ValueError(f"heads() takes {H} or {3 * H} inputs; got {x.shape[0]}.")
        if x.stride(0) == 0:  # every head reads the same stream: normalise and project it once
            q, k, v = _SharedInputQKV.apply(x, norm, self.W_shared[layer], self.b_shared[layer],
                                            self.W[layer], self.rep, H, dh)
        elif x.shape[0] == 3 * H:   # separate query, key and value inputs
            normed = norm(x)                                            # [3*head, prompt, pos, d_model]
            W, bias = self.W[layer], self.b[layer]
            q, k, v = (self.project(normed[i * H:(i + 1) * H], W[:, :, i * dh:(i + 1) * dh],
                                    None if bias is None else bias[:, i * dh:(i + 1) * dh], 1)[0]
                       for i in range(3))                               # [prompt, head, pos, d_head]
        else:
            normed = norm(x)                                            # [head, prompt, pos, d_model]
            q, k, v = self.project(normed, self.W[layer], self.b[layer], 3)  # [prompt, head, pos, d_head]
        q, k, v = self._rotated_kv(layer, q, k, v, ctx)
        z = self.attend(q, k, v, ctx["masks"].get(layer, mask), self.scaling[layer])
        return self.head_out(layer, z)

    def _rotated_kv(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    ctx: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotary embedding of q and k; the keys and values of earlier positions (``past``)
        put before this run's, and this layer's recorded where ``ctx["record"]`` asks."""
        if "cos" in ctx:
            q = _rotate(q, ctx["cos"], ctx["sin"])
            k = _rotate(k, ctx["cos"], ctx["sin"])
        past = ctx.get("past")
        if past is not None:                                     # [prompt, head, pos, d_head]
            k = torch.cat([past[layer][0], k], dim=2)
            v = torch.cat([past[layer][1], v], dim=2)
        if "record" in ctx:
            ctx["record"].append((k, v))
        return q, k, v

    def attn_write(self, layer: int, x: torch.Tensor, ctx: dict) -> torch.Tensor:
        """The attention's write [prompt, pos, d_model] (bias included) when every head reads
        ``x`` [prompt, pos, d_model]: one output projection, no per-head writes (a run whose
        head outputs are not needed, such as the prefix run that records keys and values)."""
        b, p, d = x.shape
        q, k, v = _shared_qkv(x, self.attn_norm[layer], self.W_shared[layer],
                              self.b_shared[layer], self.rep, self.n_heads, self.d_head)
        q, k, v = self._rotated_kv(layer, q, k, v, ctx)
        z = self.attend(q, k, v, ctx["masks"].get(layer, ctx["mask"]), self.scaling[layer])
        W_O = self._W_O[layer]                                           # [head, d_head, d_model]
        out = torch.matmul(z.transpose(1, 2).reshape(b, p, -1),         # [prompt, pos, H*d_head]
                           W_O.reshape(-1, W_O.shape[-1]).to(z.dtype))
        norm = self.attn_out_norm[layer]
        if norm is not None:
            out = self._out_norm(norm, out, out)
        if self._b_O[layer] is not None:
            out = out + self._b_O[layer]
        return out

    def attn_bias(self, layer: int) -> torch.Tensor | None:
        """The output projection's bias [d_model] (written once per layer, no head's), or None."""
        return self._b_O[layer]

    def mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """The MLP's write [prompt, pos, d_model] from the stream it reads."""
        y = self.mlps[layer](self.mlp_norm[layer](x))
        post = self.mlp_out_norm[layer]
        return y if post is None else post(y)

    def logits(self, resid: torch.Tensor) -> torch.Tensor:
        return self.model.lens_logits(resid)

    # -- a whole run ------------------------------------------------------------------------
    def prefix_kv(self, batch: Batch, stop: int, *, embeds: torch.Tensor | None = None
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Keys and values [prompt, head, pos, d_head] of every layer over the positions
        [0, stop) of a plain run (every head reading the stream, no head writes kept): what a
        run over the later positions reads (`prepare`'s ``past``). ``embeds`` [prompt, pos,
        d_model] replaces the input embeddings (their first ``stop`` positions are read)."""
        x = (self.embed(batch) if embeds is None else embeds)[:, :stop]  # [prompt, pos, d_model]
        ctx = self.prepare(x, batch, 0, stop)
        ctx["record"] = []
        for layer in range(self.n_layers):
            attn = self.attn_write(layer, x, ctx)
            if layer == self.n_layers - 1:
                break  # the last layer's keys and values are recorded; its stream is not read
            m = self.mlp(layer, x if self.parallel else x + attn)
            x = x + attn + m
        return ctx["record"]

    def forward(self, batch: Batch, *, embeds: torch.Tensor | None = None, start: int = 0,
                past: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> EngineRun:
        """The model's forward with every head's write kept (each head reads the stream).

        With ``start`` and ``past`` (`prefix_kv` of the positions before ``start``), only the
        positions from ``start`` on; ``embeds`` and every result then cover those."""
        x = self.embed(batch)[:, start:] if embeds is None else embeds  # [prompt, pos, d_model]
        b, p, d = x.shape
        ctx = self.prepare(x, batch, start, past=past)
        mask = ctx["mask"]
        pre, heads, mlps = [], [], []
        for layer in range(self.n_layers):
            pre.append(x)
            h = self.heads(layer, x[None].expand(self.n_heads, b, p, d), mask, ctx)
            attn = h.sum(0)
            if self._b_O[layer] is not None:
                attn = attn + self._b_O[layer]
            m = self.mlp(layer, x if self.parallel else x + attn)
            x = x + attn + m
            heads.append(h)
            mlps.append(m)
        return EngineRun(torch.stack(pre), torch.stack(heads), torch.stack(mlps), self.logits(x))
