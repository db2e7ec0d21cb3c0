"""Engine logprobs -> OpenAI's two wire formats (chat ``logprobs.content`` and legacy completions' columns).

There is one entry per generated token (``usage.completion_tokens`` of them, the end-of-turn token included), each
the target's raw log-probability; token strings are the token decoded on its own (special tokens shown), bytes
its UTF-8 encoding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

TokenLogprob = tuple[int, float, list[tuple[int, float]]]


class TokenText:
    """Token id -> its text, cached (a response repeats the same alternatives many times)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, tid: int) -> str:
        text = self._cache.get(tid)
        if text is None:
            text = self._cache[tid] = self.tokenizer.decode([tid], skip_special_tokens=False)
        return text


def chat_logprobs(entries: Sequence[TokenLogprob], token: Callable[[int], str]) -> dict[str, Any]:
    """``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}``."""
    def one(tid: int, lp: float) -> dict[str, Any]:
        t = token(tid)
        return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}

    return {"content": [{**one(tid, lp), "top_logprobs": [one(a, alp) for a, alp in alts]}
                        for tid, lp, alts in entries], "refusal": None}


def completion_logprobs(entries: Sequence[TokenLogprob], token: Callable[[int], str],
                        offset: int = 0) -> dict[str, Any]:
    """``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``; offsets continue from ``offset``."""
    tokens, offsets = [], []
    for tid, _, _ in entries:
        t = token(tid)
        offsets.append(offset)
        tokens.append(t)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [{token(a): alp for a, alp in alts} for _, _, alts in entries],
            "text_offset": offsets}
