"""A tiny GGUF shaped like the packaged SmolLM2's (llama architecture, byte-level BPE
tokenizer under llama.cpp's key names, the q/k rows in llama.cpp's order), written from the
tiny-llama model: the conversion of the packaged model (`explorer.models.smollm2_folder`)
runs on it in a second instead of half a minute. Tensors are float32, so the converted
model's weights are tiny-llama's exactly."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def _llama_cpp_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """q/k rows in llama.cpp's order (its convert_hf_to_gguf.py `permute`; transformers'
    GGUF loader reverses it)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_tiny_gguf(path: Path, model) -> Path:
    """Write ``model`` (tiny-llama) and its tokenizer as a GGUF file at ``path``."""
    import gguf

    cfg, hf = model.hf.config, model.hf
    tok = json.loads(model.tokenizer.backend_tokenizer.to_str())["model"]
    tokens = [t for t, _ in sorted(tok["vocab"].items(), key=lambda kv: kv[1])]
    n_trained = len(tokens)          # the trained vocabulary is smaller than the embedding
    tokens += [f"[PAD{i}]" for i in range(n_trained, cfg.vocab_size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["merges"]]
    special = set(model.tokenizer.all_special_tokens)
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_name("tiny-llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(len(tokens))
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.UNUSED if i >= n_trained else gguf.TokenType.CONTROL
                       if t in special else gguf.TokenType.NORMAL for i, t in enumerate(tokens)])
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    w.add_pad_token_id(cfg.pad_token_id)
    w.add_add_bos_token(False)

    def add(name, tensor, n_head=None):
        a = tensor.detach().float().numpy()
        w.add_tensor(name, _llama_cpp_rows(a, n_head) if n_head else a)

    add("token_embd.weight", hf.model.embed_tokens.weight)
    for i, layer in enumerate(hf.model.layers):
        att, mlp = layer.self_attn, layer.mlp
        add(f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight)
        add(f"blk.{i}.attn_q.weight", att.q_proj.weight, cfg.num_attention_heads)
        add(f"blk.{i}.attn_k.weight", att.k_proj.weight, cfg.num_key_value_heads)
        add(f"blk.{i}.attn_v.weight", att.v_proj.weight)
        add(f"blk.{i}.attn_output.weight", att.o_proj.weight)
        add(f"blk.{i}.ffn_norm.weight", layer.post_attention_layernorm.weight)
        add(f"blk.{i}.ffn_gate.weight", mlp.gate_proj.weight)
        add(f"blk.{i}.ffn_up.weight", mlp.up_proj.weight)
        add(f"blk.{i}.ffn_down.weight", mlp.down_proj.weight)
    add("output_norm.weight", hf.model.norm.weight)
    add("output.weight", hf.lm_head.weight)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
