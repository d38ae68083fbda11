"""The per-node forward of the circuit graph on the core's per-head engine
(`explorer.heads.HeadEngine`): each head reads its own copy of the residual stream, so an edge
can be patched on its own."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from explorer._checks import ExplorerError
from explorer.analyses.circuits.graph import _dst_layout
from explorer.heads import HeadEngine, causal_mask, check_engine_family
from explorer.lora import LoRAWeights
from explorer.models import Batch, Model

__all__ = ['circuit_engine', 'graph_forward']


def circuit_engine(model: Model, lora: LoRAWeights | None = None) -> HeadEngine:
    """The per-head engine on the model's weights (local ones; a remote model's runs on the
    server through `explorer.trace.run_on_weights`), with ``lora``'s adapters if given."""
    check_engine_family(model)
    if model.remote:
        raise ExplorerError("the circuit forward needs the weights; a remote model's circuit "
                            "runs on the server (run_on_weights).")
    if lora is not None:
        lora = lora.to(_weights_device(model))
    return HeadEngine(model, lora)


def _weights_device(model: Model) -> torch.device:
    return model.hf.device  # a Hugging Face model's, or on the server the root envoy's


@dataclass
class _Run:
    outs: torch.Tensor            # [src, prompt, pos, d_model], each source node's write
    inputs: list[torch.Tensor]    # per destination group: heads [head, p, pos, d], MLP/logits [1, p, pos, d]
    resid_in: list[torch.Tensor]  # per destination group: residual stream it read, [p, pos, d]
    logits: torch.Tensor          # [prompt, vocab] at the last position


def _gather(diff: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Sum of source differences over the kept edges: diff [src, prompt, pos, d_model],
    keep [src, dst] bool -> [dst, prompt, pos, d_model]. Only sources with a kept edge are read."""
    used = keep.any(1)
    n_dst = keep.shape[1]
    n, b, p, d = diff.shape
    n_used = int(used.sum())
    if n_used == 0:
        return diff.new_zeros(n_dst, b, p, d)
    if n_used == n:
        sel, k = diff.reshape(n, -1), keep                          # [src, prompt*pos*d_model]
    else:
        rows = used.nonzero().flatten()
        sel, k = diff[rows].reshape(n_used, -1), keep[rows]
    return (k.T.to(diff.dtype) @ sel).view(n_dst, b, p, d)


def _patched_input(resid: torch.Tensor, corrupt_resid: torch.Tensor, diff: torch.Tensor,
                   keep: torch.Tensor) -> torch.Tensor:
    """Inputs [dst, prompt, pos, d_model] of a destination group whose sources are ``diff``
    (this run minus the corrupted run, [src, ...]) and whose kept edges are ``keep`` [src, dst].

    Either the corrupted input plus the kept differences, or this run's residual stream minus
    the dropped differences (the two are equal), whichever reads fewer sources.
    """
    n_kept = int(keep.any(1).sum())
    n_dropped = int((~keep).any(1).sum())
    if n_kept <= n_dropped:
        return corrupt_resid[None] + _gather(diff, keep)
    return resid[None] - _gather(diff, ~keep)


def graph_forward(ad: HeadEngine, batch: Batch, *, embeds: torch.Tensor | None = None,
                  patch: tuple[_Run, torch.Tensor] | None = None, start: int = 0,
                  past: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                  split_qkv: bool = False) -> _Run:
    """One run over the node graph.

    Without ``patch`` every node reads the running residual stream (the model's own forward).
    With ``patch=(corrupt_run, keep)``, ``keep`` a float [src, dst] mask of circuit edges, each
    destination reads the corrupted run's input plus, over its circuit edges, this run's
    minus the corrupted run's source outputs: every non-circuit edge carries its corrupted value.
    With ``ad.parallel`` (GPT-NeoX) each MLP reads what its layer's heads read.

    ``start`` (unpatched runs): only the positions from ``start`` on, the heads reading the
    earlier positions' keys and values from ``past`` (`HeadEngine.prefix_kv`); ``embeds``,
    the outputs and the inputs then cover those positions only.

    ``split_qkv``: each head reads three inputs (query, key, value; the heads' group of
    ``inputs`` is then [3*head, ...]); a patched run is split when ``keep`` has the split
    graph's destinations.
    """
    if patch is not None and start:
        raise ValueError("a patched run covers every position (start=0).")
    L, H = ad.n_layers, ad.n_heads
    parallel = getattr(ad, "parallel", False)
    if patch is not None:
        split_qkv = patch[1].shape[1] == L * (3 * H + 1) + 1
    d_stride, n_in = _dst_layout(H, split_qkv)
    x0 = ad.embed(batch)[:, start:] if embeds is None else embeds   # [prompt, pos, d_model]
    b, p, d = x0.shape
    ctx = ad.prepare(x0, batch) if past is None else ad.prepare(x0, batch, start, past=past)
    mask = causal_mask(batch)[:, :, start:]                         # [prompt, 1, q, k]
    stride = H + 1
    n_src = 1 + L * stride
    outs: list[torch.Tensor] = [x0[None]]
    inputs: list[torch.Tensor] = []
    resid_in: list[torch.Tensor] = []
    if patch is not None:
        corrupt, keep = patch
        keep = keep.bool()
        diff = x0.new_zeros(n_src, b, p, d)  # [src, prompt, pos, d_model]
        diff[0] = x0 - corrupt.outs[0]
    resid = x0
    for layer in range(L):
        base, dbase = layer * stride, layer * d_stride
        g = 2 * layer  # destination group index: heads of layer, then its MLP
        if patch is None:
            x_heads = resid[None].expand(n_in, b, p, d)     # [head (x3 split), prompt, pos, d_model]
        else:
            n = 1 + base
            x_heads = _patched_input(resid, corrupt.resid_in[g], diff[:n],
                                     keep[:n, dbase:dbase + n_in])
        inputs.append(x_heads)
        resid_in.append(resid)
        resid_pre = resid
        head_out = ad.heads(layer, x_heads, mask, ctx)        # [head, prompt, pos, d_model]
        outs.append(head_out)
        resid = resid + head_out.sum(0)
        bias = ad.attn_bias(layer)
        if bias is not None:
            resid = resid + bias
        mlp_reads = resid_pre if parallel else resid          # the stream the MLP reads
        if patch is None:
            x_mlp = mlp_reads[None].clone()  # its own tensor: its gradient is the MLP's alone
        else:
            diff[1 + base:1 + base + H] = head_out - corrupt.outs[1 + base:1 + base + H]
            n = 1 + base + (0 if parallel else H)
            x_mlp = _patched_input(mlp_reads, corrupt.resid_in[g + 1], diff[:n],
                                   keep[:n, dbase + n_in:dbase + n_in + 1])
        inputs.append(x_mlp)
        resid_in.append(mlp_reads)
        mlp_out = ad.mlp(layer, x_mlp[0])                     # [prompt, pos, d_model]
        outs.append(mlp_out[None])
        resid = resid + mlp_out
        if patch is not None:
            diff[1 + base + H] = mlp_out - corrupt.outs[1 + base + H]
    if patch is None:
        x_logits = resid[None].clone()
    else:
        x_logits = _patched_input(resid, corrupt.resid_in[-1], diff, keep[:, -1:])
    inputs.append(x_logits)
    resid_in.append(resid)
    logits = ad.logits(x_logits[0, :, -1])                    # [prompt, vocab], left padding
    # a patched run's callers read its logits only: its outputs are not stacked
    return _Run(torch.cat(outs, dim=0) if patch is None else x0.new_zeros(0), inputs,
                resid_in, logits)
