"""Engine logprobs -> OpenAI's two wire formats (chat ``logprobs.content`` and legacy completions' columns).

There is one entry per generated token (``usage.completion_tokens`` of them, the end-of-turn token included), each
the target's raw log-probability. Token strings are what vLLM returns (``vllm/v1/engine/logprobs.py``): the token
decoded on its own with special tokens shown (``<|end|>``, ``<think>``: vLLM's ``convert_ids_list_to_tokens`` uses
the tokenizer's default, which keeps them), ``bytes`` its UTF-8 encoding. A token that ends inside a multi-byte
character decodes to U+FFFD; vLLM then shows it as ``""`` and the token that completes the character as the whole
character (``_correct_decoded_token``), so that the strings add up to the text. We do the same from the tokens
that are still open, exactly, where vLLM tries the previous token only.

``text_offset`` (completions) is each token's position in the returned ``text``. vLLM adds up token string
lengths, which shifts every later offset by the length of each special token the text skips (the text is decoded
with special tokens skipped, vLLM's default too); here a skipped special token takes no room in the text, so every
offset points into it. The offsets assume byte-level BPE (Llama-3, Qwen, DeepSeek/Kimi, the tiny target), whose
token strings concatenate to the text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

TokenLogprob = tuple[int, float, list[tuple[int, float]]]
REPLACEMENT = "\ufffd"
MAX_OPEN = 3
"""tokens that may end inside one character before the next completes it (UTF-8 has at most 4 bytes)"""


class TokenText:
    """Token id -> its text, cached (a response repeats the same alternatives many times); which ids are special."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        special = set(getattr(tokenizer, "all_special_ids", None) or [])
        for tid, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
            if getattr(tok, "special", False):
                special.add(int(tid))
        self.special = frozenset(special)
        """ids the text skips (decoded with ``skip_special_tokens=True``)"""

    def __call__(self, tid: int) -> str:
        text = self._cache.get(tid)
        if text is None:
            text = self._cache[tid] = self.tokenizer.decode([tid], skip_special_tokens=False)
        return text

    def join(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


class LogprobText:
    """One request's token strings and text offsets, carried across the chunks of a stream."""

    def __init__(self, token_text: TokenText) -> None:
        self.tt = token_text
        self.open: list[int] = []
        """the latest generated tokens that end inside a character (shown as "" so far)"""
        self.offset = 0
        """characters of the text before the next generated token"""

    def string(self, tid: int) -> str:
        """The string of ``tid`` at the next position (the generated token or one of its alternatives)."""
        text = self.tt(tid)
        if not text.endswith(REPLACEMENT) or tid in self.tt.special:
            return text
        joined = self.tt.join([*self.open, tid])
        return "" if joined.endswith(REPLACEMENT) else joined

    def advance(self, tid: int, text: str) -> int:
        """The generated token ``tid`` (shown as ``text``) takes the next position: its offset in the text."""
        at = self.offset
        if tid in self.tt.special:
            self.open = []
            return at
        self.offset += len(text)
        self.open = [*self.open, tid][-MAX_OPEN:] if text == "" and self.tt(tid).endswith(REPLACEMENT) else []
        return at

    def entries(self, logprobs: Sequence[TokenLogprob]) -> list[tuple[str, float, int, list[tuple[str, float]]]]:
        """Per generated token: (string, logprob, text offset, [(alternative string, logprob)])."""
        out = []
        for tid, lp, alts in logprobs:
            text = self.string(tid)
            top = [(self.string(a), alp) for a, alp in alts]
            out.append((text, lp, self.advance(tid, text), top))
        return out


def chat_logprobs(logprobs: Sequence[TokenLogprob], state: LogprobText) -> dict[str, Any]:
    """``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}``."""
    def one(t: str, lp: float) -> dict[str, Any]:
        return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}

    return {"content": [{**one(t, lp), "top_logprobs": [one(a, alp) for a, alp in top]}
                        for t, lp, _, top in state.entries(logprobs)], "refusal": None}


def completion_logprobs(logprobs: Sequence[TokenLogprob], state: LogprobText,
                        text_len: int | None = None) -> dict[str, Any]:
    """``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``; offsets continue from earlier chunks and
    stop at ``text_len`` (tokens of a stop string past the cut text)."""
    entries = state.entries(logprobs)
    cap = (lambda at: min(at, text_len)) if text_len is not None else (lambda at: at)
    return {"tokens": [t for t, _, _, _ in entries], "token_logprobs": [lp for _, lp, _, _ in entries],
            "top_logprobs": [dict(top) for _, _, _, top in entries],
            "text_offset": [cap(at) for _, _, at, _ in entries]}
