"""The decoder's records: a finished request's result, a streamed chunk, a row of a decode batch and the batch (kept
apart from ``decoder`` so the decoding logic reads on its own)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from eaglenest.contracts.metrics import accept_length
from eaglenest.engines.base import OutputConstraint
from eaglenest.speculative.logits import TokenLogprob


@dataclass
class SpecResult:
    """One finished request with its speculation statistics (see the module docstring)."""

    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    draft_steps: int = 0
    accepted_per_step: list[int] = field(default_factory=list)
    draft_tokens: int = 0
    """draft tokens proposed over all steps (steps differ in size when a schedule changes the shape)"""
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    prefill_time_s: float = 0.0
    total_time_s: float = 0.0

    @property
    def accept_length(self) -> float:
        """Tokens per target verify forward, bonus included (1.0 = nothing accepted)."""
        return accept_length(len(self.accepted_per_step), sum(self.accepted_per_step))

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.total_time_s if self.total_time_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "token_ids": self.token_ids, "text": self.text, "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "draft_steps": self.draft_steps, "accepted_per_step": self.accepted_per_step,
            "draft_tokens": self.draft_tokens,
            "accept_length": self.accept_length, "draft_time_s": self.draft_time_s,
            "verify_time_s": self.verify_time_s, "prefill_time_s": self.prefill_time_s,
            "total_time_s": self.total_time_s,
        }


@dataclass
class StreamChunk:
    """Tokens emitted by one target forward of a streamed request."""

    token_ids: list[int]
    step: int
    """0 for the prefill token, then 1, 2, ... per verify forward"""
    accepted: int | None
    """draft tokens accepted in this step (None for the prefill token)"""
    finished: bool = False
    finish_reason: str | None = None
    result: SpecResult | None = None
    """the whole request, on the last chunk"""
    logprobs: list[TokenLogprob] | None = None
    """one entry per token of ``token_ids`` when the sampling asked for logprobs"""


@dataclass
class DecodeRow:
    """One request's decoding state; a caller (``generate``, a continuous-batching scheduler) owns a table
    ``{row id: DecodeRow}`` and passes it to :meth:`SpecDecoder.prefill` / :meth:`SpecDecoder.step`."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    accepted: list[int] = field(default_factory=list)
    """draft tokens accepted at each step that drafted (a step a schedule ran without drafting adds nothing)"""
    proposed: int = 0
    """draft tokens proposed to the target so far"""
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_s: float = 0.0
    start: float = 0.0
    end: float = 0.0
    step_logprobs: list[TokenLogprob] | None = None
    """logprobs of the tokens the last forward proposed for this row (cut to what ``_emit`` took)"""
    constraint: OutputConstraint | None = None
    """this row's structured output (None: the sampling setting's, if any)"""
    guide: Any = None
    """the grammar state of a constrained row (:class:`~eaglenest.speculative.guide.RowGuide`), set at its prefill"""

    @property
    def finished(self) -> bool:
        return self.finish is not None

    def cancel(self) -> None:
        """Stop decoding this row (its client went away): it emits nothing more and leaves the batch at the next
        :meth:`SpecDecoder.drop_finished`."""
        if self.finish is None:
            self.finish = "cancelled"


@dataclass
class DecodeBatch:
    """Decoding state of the active rows: ``rows`` holds their ids, every tensor's dim 0 is the active row.

    Target side: KV cache ``t_cache``, slot validity ``t_valid [B, L]``, next RoPE position ``next_pos [B]``, the
    token to decode next ``pending [B]``, per-row RNGs ``gens``. Drafter side (None without a drafter): its cache,
    slot validity, the logits / hidden state the next draft tree grows from, and the catch-up it still owes.
    Batches of one decoder and one sampling setting can be stacked (:func:`eaglenest.speculative.batching.
    merge_batches`).
    """

    rows: list[int]
    t_cache: Any
    t_valid: torch.Tensor
    next_pos: torch.Tensor
    pending: torch.Tensor
    gens: list[torch.Generator | None]
    d_cache: Any = None
    d_valid: torch.Tensor | None = None
    root_logits: torch.Tensor | None = None
    root_hidden: torch.Tensor | None = None
    backlog: list[Any] = field(default_factory=list)
    """the drafter's deferred catch-up after steps that did not draft (:mod:`eaglenest.speculative.backlog`)"""
