"""Tokens holding part of a character's UTF-8 bytes read as byte escapes, on both vocabularies:
byte-level BPE (the tiny models, SmolLM2) against bytes worked out by hand."""
from __future__ import annotations

import pytest

from apps.theme import show_tokens
from explorer.models import token_bytes, token_text


def test_partial_utf8_tokens_read_as_byte_escapes(tiny_model):
    tok = tiny_model.tokenizer
    text = "a 😀 中"                                  # U+1F600 = f0 9f 98 80, 中 = e4 b8 ad
    ids = tok(text, add_special_tokens=False)["input_ids"]
    shown = tiny_model.token_strings(ids)
    # every token's bytes, put back together, are the text's UTF-8 bytes
    assert b"".join(token_bytes(tok, i) for i in ids) == text.encode("utf-8")
    assert "\ufffd" not in "".join(shown)
    # the tiny byte-level vocabulary splits the emoji and the CJK character into single bytes
    assert [s for s in shown if s.startswith("\\x")] == [
        "\\xf0", "\\x9f", "\\x98", "\\x80", "\\xe4", "\\xb8", "\\xad"]
    # whole characters and plain words stay as decoded
    assert shown[0] == tok.decode([ids[0]]) == "a"
    # what the pages show (theme.show_tokens): the escapes as text, the space visible
    assert show_tokens([" \\xf0\\x9f\\x98"]) == ["·\\xf0\\x9f\\x98"]


def test_a_token_decoding_to_whole_characters_is_unchanged(tiny_model):
    tok = tiny_model.tokenizer
    for i in tok(" the cat", add_special_tokens=False)["input_ids"]:
        assert token_text(tok, i) == tok.decode([i])


class _SentencePieceLike:
    """A byte-fallback vocabulary: byte tokens are spelled <0xNN>."""

    def decode(self, ids):
        return "\ufffd"

    def convert_ids_to_tokens(self, i):
        return "<0xE2>"


def test_sentencepiece_byte_fallback_tokens_read_as_escapes():
    assert token_text(_SentencePieceLike(), 5) == "\\xe2"


@pytest.mark.integration
def test_smollm2_emoji_and_cjk_tokens(smollm2):
    ids = smollm2.tokenizer("Hi 😀 ☃", add_special_tokens=False)["input_ids"]
    shown = smollm2.token_strings(ids)
    # 😀 = f0 9f 98 80 and ☃ = e2 98 83, split by SmolLM2's vocabulary after the space
    assert shown == ["Hi", " \\xf0\\x9f\\x98", "\\x80", " \\xe2", "\\x98", "\\x83"]
