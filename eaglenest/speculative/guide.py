"""Structured output on the reference decoder: a grammar mask on every target distribution a constrained row draws from.

A row with an :class:`~eaglenest.engines.base.OutputConstraint` carries a :class:`RowGuide`: an llguidance matcher
compiled from the JSON Schema (or the Lark grammar of a required tool call) over the target's tokenizer, and the
reasoning phase when the request separates reasoning (the answer may open with a reasoning block, unconstrained; the
grammar applies from its end on).

Where the mask goes (``SpecDecoder``): the prefill's first token, and every node of a verify step's tree, where node
``c`` is masked with the grammar state after the draft tokens on the path to ``c`` (walked depth first, rolled back
after each subtree). Greedy matching and rejection sampling then run on the masked logits, unchanged: a draft token
the grammar forbids has target probability 0 and is rejected, so the speculative answer equals plain constrained
decoding's token for token (greedy) or follows its distribution (sampling). A draft chain also proposes under the
grammar (:class:`ChainGuide`: a token the grammar forces is then a draft the target accepts; a sampled chain's
proposal distribution is the masked one, so rejection sampling stays exact). A tree would draft free (its branches
would each need a grammar state while drafting) and be rejected, so a step with a constrained row drafts the chain of
the tree's depth instead. A row ends ``stop`` as soon as the grammar is complete (nothing but an end token could
follow).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import torch

from eaglenest.engines.base import OutputConstraint

Phase = Literal["open", "thinking", "answer"]
"""open: may start a reasoning block or the answer; thinking: inside the block (free); answer: the schema applies"""


@functools.lru_cache(maxsize=256)
def compile_schema(schema: str) -> str:
    """The llguidance grammar of a JSON Schema (canonical JSON text): compact JSON, no free whitespace."""
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})


def compile_constraint(constraint: OutputConstraint) -> str:
    """The llguidance grammar of a constraint (its schema's, or its Lark grammar's)."""
    if constraint.schema is not None:
        return compile_schema(constraint.schema)
    return compile_lark(constraint.lark or "")


@functools.lru_cache(maxsize=256)
def compile_lark(lark: str) -> str:
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_lark(lark)


def schema_error(schema: dict[str, Any]) -> str | None:
    """Why ``schema`` cannot constrain an answer (None: it can); checked before a request is admitted."""
    from llguidance import LLMatcher

    try:
        grammar = compile_schema(canonical_schema(schema))
    except ValueError as e:
        return str(e)
    err = LLMatcher.validate_grammar(grammar)
    return err or None


def grammar_error(lark: str) -> str | None:
    """Why a Lark grammar cannot constrain an answer (None: it can), e.g. a tool's ``parameters`` it embeds."""
    from llguidance import LLMatcher

    return LLMatcher.validate_grammar(compile_lark(lark)) or None


def canonical_schema(schema: dict[str, Any]) -> str:
    """The schema as compact JSON text, the hashable form :class:`OutputConstraint` holds (key order kept: the
    answer's properties come in the schema's order)."""
    return json.dumps(schema, separators=(",", ":"))


def next_token_masks(guides: Sequence[RowGuide | None], vocab_size: int) -> torch.Tensor:
    """``[B, V]`` bool: each row's allowed next tokens (every token for a row without a guide)."""
    return torch.stack([g.mask() if g is not None else torch.ones(vocab_size, dtype=torch.bool) for g in guides])


class GuideCompiler:
    """Builds :class:`RowGuide` s for one target: the llguidance view of its tokenizer is made once, on first use.

    ``vocab_size`` is the width of the target's logits (it may exceed the tokenizer's; the extra ids are never
    allowed); ``eos_ids`` are the tokens that end an answer (allowed where the grammar is complete)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Iterable[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.eos_ids = frozenset(int(t) for t in eos_ids)
        self._ll_tokenizer: Any = None

    def guide(self, constraint: OutputConstraint) -> RowGuide:
        from llguidance import LLMatcher
        from llguidance.hf import from_tokenizer

        if self._ll_tokenizer is None:  # one end token (llguidance < 1.0, SGLang 0.5.14's pin, takes no list):
            primary = getattr(self.tokenizer, "eos_token_id", None)  # RowGuide.mask allows the others alike
            if primary not in self.eos_ids:
                primary = min(self.eos_ids) if self.eos_ids else None
            try:
                self._ll_tokenizer = from_tokenizer(self.tokenizer, n_vocab=self.vocab_size, eos_token=primary)
            except Exception as e:  # e.g. a slow (sentencepiece-only) tokenizer: this request fails, not the batch
                raise ValueError(f"structured output needs the target's tokenizer in llguidance, which refused it "
                                 f"({type(e).__name__}: {e}); a fast (tokenizers) tokenizer is needed") from e
        matcher = LLMatcher(self._ll_tokenizer, compile_constraint(constraint), log_level=0)
        if matcher.is_error():
            raise ValueError(f"cannot constrain the answer to this grammar: {matcher.get_error()}")
        return RowGuide(matcher, self.vocab_size, self.eos_ids, constraint)


class RowGuide:
    """One row's grammar state: the allowed next tokens, advanced token by token and rolled back over a tree."""

    def __init__(self, matcher: Any, vocab_size: int, eos_ids: frozenset[int], constraint: OutputConstraint) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.reasoning = constraint.reasoning
        self.phase: Phase = "answer"
        if self.reasoning is not None:
            self.phase = "thinking" if constraint.in_reasoning else "open"
        self._history: list[tuple[Phase, bool]] = []
        """per advanced token: the phase before it, and whether the matcher consumed it (for ``retreat``)"""

    @property
    def done(self) -> bool:
        """The answer is complete: the grammar accepts nothing more but an end token."""
        return self.phase == "answer" and self.matcher.is_stopped()

    def mask(self) -> torch.Tensor:
        """``[V]`` bool: the tokens allowed next."""
        if self.phase == "thinking":  # free, but the answer must follow: no end token before the reasoning's end
            allowed = torch.ones(self.vocab_size, dtype=torch.bool)
            allowed[sorted(self.eos_ids)] = False
            return allowed
        if self.matcher.is_error():  # cannot happen through advance(); end the answer rather than run free
            allowed = torch.zeros(self.vocab_size, dtype=torch.bool)
            allowed[sorted(self.eos_ids)] = True
            return allowed
        bias = self.matcher.compute_logit_bias()
        allowed = torch.frombuffer(bytearray(bias), dtype=torch.uint8)[: self.vocab_size] > 0
        if self.phase == "open" and self.reasoning is not None:
            allowed[self.reasoning[0]] = True
        if self.eos_ids and self.matcher.is_accepting():  # the answer may end: by any of the target's end tokens
            allowed[sorted(self.eos_ids)] = True
        return allowed

    def advance(self, token: int) -> None:
        """Take ``token`` (one the last :meth:`mask` allowed)."""
        before, consumed = self.phase, False
        if self.phase == "thinking":
            if self.reasoning is not None and token == self.reasoning[1]:
                self.phase = "answer"
        elif self.phase == "open" and self.reasoning is not None and token == self.reasoning[0]:
            self.phase = "thinking"
        elif token not in self.eos_ids:
            self.phase = "answer"
            consumed = self.matcher.consume_token(int(token))
            if not consumed:
                raise ValueError(f"token {token} breaks the answer's grammar: {self.matcher.get_error()}")
        self._history.append((before, consumed))

    def retreat(self, n: int) -> None:
        """Undo the last ``n`` :meth:`advance` s."""
        consumed = 0
        for _ in range(n):
            before, took = self._history.pop()
            self.phase = before
            consumed += took
        if consumed:
            self.matcher.rollback(consumed)

    def tree_masks(self, tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """``[N, V]`` bool for a draft tree whose root (column 0) is the state now: node ``c``'s mask follows the
        draft tokens on its path. A node the grammar cannot reach keeps an all-true mask: its parent's mask already
        rejects it, so what comes after it is never used."""
        n = len(tokens)
        masks = torch.ones(n, self.vocab_size, dtype=torch.bool)
        kids: list[list[int]] = [[] for _ in range(n)]
        for c in range(n):
            if parents[c] >= 0:
                kids[parents[c]].append(c)
        masks[0] = self.mask()

        def visit(node: int) -> None:  # depth first; a tree is num_steps + 1 deep
            for child in kids[node]:
                tok = int(tokens[child])
                if not bool(masks[node, tok]) or tok in self.eos_ids:
                    continue
                self.advance(tok)
                masks[child] = self.mask()
                visit(child)
                self.retreat(1)

        visit(0)
        return masks


class ChainGuide:
    """The grammar on a draft chain (``build_tree``'s ``chain_mask``): each level proposes only tokens the target's
    grammar allows after the levels before it, so a constrained row's drafts are not wasted on forbidden tokens.
    A row whose grammar allows nothing in the draft vocabulary (or whose chain ended) drafts unmasked from there.
    :meth:`release` rolls every guide back to where the chain started."""

    def __init__(self, guides: Sequence[RowGuide | None], token_map: torch.Tensor | None, vocab_size: int) -> None:
        self.guides = list(guides)
        self.token_map = token_map.cpu() if token_map is not None else None
        self.vocab_size = vocab_size
        self.advanced = [0] * len(self.guides)
        self.free = [g is None for g in self.guides]
        self.last: list[torch.Tensor | None] = [None] * len(self.guides)

    def __call__(self, prev: torch.Tensor | None) -> torch.Tensor:
        if prev is not None:
            for j, tok in enumerate(prev.cpu().tolist()):
                guide, last = self.guides[j], self.last[j]
                if self.free[j] or guide is None or last is None:
                    continue
                if not bool(last[tok]) or tok in guide.eos_ids:
                    self.free[j] = True
                    continue
                guide.advance(int(tok))
                self.advanced[j] += 1
        rows = []
        for j, guide in enumerate(self.guides):
            full = torch.ones(self.vocab_size, dtype=torch.bool) if self.free[j] or guide is None else guide.mask()
            self.last[j] = full
            draft = full if self.token_map is None else full[self.token_map]
            if not bool(draft.any()):
                self.free[j] = True
                draft = torch.ones_like(draft)
            rows.append(draft)
        return torch.stack(rows)

    def release(self) -> None:
        for j, guide in enumerate(self.guides):
            if guide is not None and self.advanced[j]:
                guide.retreat(self.advanced[j])
        self.advanced = [0] * len(self.guides)
