"""serve.logprobs with the tiny target's real tokenizer: token strings as vLLM shows them, offsets into the text.

The tiny target's tokenizer is byte-level BPE with special tokens (``<|end|>``, ``<think>``, ``<tool_call>``); "é",
"ö" and "日本" split into tokens that end inside a character. The e2e check through the official client is
``tests/e2e/test_serve_app.py::test_logprobs``.
"""

from __future__ import annotations

import pytest

from eaglenest.serve.logprobs import LogprobText, TokenText, chat_logprobs, completion_logprobs

TEXT = "héllo wörld 日本 ok"


@pytest.fixture(scope="module")
def tt(tiny_target_path) -> TokenText:
    from transformers import AutoTokenizer

    return TokenText(AutoTokenizer.from_pretrained(str(tiny_target_path)))


def _ids(tt: TokenText) -> list[int]:
    """TEXT's tokens with special tokens around and inside it, as a model may generate them."""
    vocab = tt.tokenizer.get_vocab()
    words = [tt.tokenizer.encode(w, add_special_tokens=False) for w in ("héllo wörld", " 日本", " ok")]
    return [vocab["<think>"], *words[0], vocab["</think>"], *words[1], *words[2], vocab["<|end|>"]]


def _entries(ids: list[int]) -> list[tuple[int, float, list[tuple[int, float]]]]:
    return [(t, -0.5, [(t, -0.5), (ids[0], -2.0)]) for t in ids]


def test_the_tokenizer_splits_characters_and_has_special_tokens(tt):
    """The premise: single-token decodes show U+FFFD, and the text skips the special tokens."""
    ids = _ids(tt)
    assert any(tt(t).endswith("\ufffd") for t in ids)
    assert tt.tokenizer.decode(ids, skip_special_tokens=True) == TEXT
    assert {tt(t) for t in ids if t in tt.special} == {"<think>", "</think>", "<|end|>"}


@pytest.mark.parametrize("chunks", [(99,), (1,), (2, 3), (5, 1)])
def test_offsets_point_into_the_text_and_strings_add_up_to_it(tt, chunks):
    ids = _ids(tt)
    state, got, i, k = LogprobText(tt), {"tokens": [], "text_offset": [], "top_logprobs": []}, 0, 0
    while i < len(ids):  # a stream sends them a few at a time; the offsets carry over
        n = chunks[k % len(chunks)]
        part = completion_logprobs(_entries(ids[i:i + n]), state)
        for key in got:
            got[key] += part[key]
        i, k = i + n, k + 1
    tokens, offsets = got["tokens"], got["text_offset"]
    assert len(tokens) == len(offsets) == len(ids)
    assert offsets == sorted(offsets) and offsets[-1] == len(TEXT)
    for tid, tok, at in zip(ids, tokens, offsets, strict=True):
        if tid in tt.special:  # shown as vLLM shows it, taking no room in the text
            assert tok == tt(tid)
        else:
            assert TEXT[at:at + len(tok)] == tok
    assert "".join(t for t, tid in zip(tokens, ids, strict=True) if tid not in tt.special) == TEXT
    # whole tokens keep vLLM's string (the token decoded on its own); split characters: "" then the character
    for tid, tok in zip(ids, tokens, strict=True):
        if not tt(tid).endswith("\ufffd"):
            assert tok == tt(tid)
    assert "" in tokens and "é" in tokens and "日" in tokens


def test_the_old_offsets_were_shifted(tt):
    """Control: summing token strings as vLLM does (special tokens and U+FFFD counted) misses the text."""
    ids = _ids(tt)
    naive, at = [], 0
    for t in ids:
        naive.append(at)
        at += len(tt(t))
    good = completion_logprobs(_entries(ids), LogprobText(tt))["text_offset"]
    assert naive != good and naive[-1] > len(TEXT)


def test_offsets_stop_at_the_cut_text(tt):
    ids = _ids(tt)
    cut = TEXT.index(" ok")  # a stop string " ok": the text ends before it
    offsets = completion_logprobs(_entries(ids), LogprobText(tt), text_len=cut)["text_offset"]
    assert max(offsets) == cut


def test_chat_bytes_add_up_to_the_text(tt):
    ids = _ids(tt)
    content = chat_logprobs(_entries(ids), LogprobText(tt))["content"]
    raw = b"".join(bytes(e["bytes"]) for e, t in zip(content, ids, strict=True) if t not in tt.special)
    assert raw.decode("utf-8") == TEXT
    assert all(e["top_logprobs"][0]["token"] == e["token"] for e in content)  # the same string at one position
