"""Target-logit processing that depends on the context, and the log-probabilities a request asked for.

Repetition penalty (CTRL / transformers / vLLM): every token already in the context has its logit divided by the
penalty when positive, multiplied when negative. In a verify step the context of tree node ``c`` is the row's
prompt and committed output plus the draft tokens on the path to ``c`` (``tree.ancestors``, which includes ``c``),
so every node is scored exactly as plain decoding would score that position; greedy and rejection sampling then run
on the penalised logits and stay exact.

Log-probabilities are the target's *raw* distribution (log-softmax of the logits before temperature, penalties and
filters: vLLM's default ``raw_logprobs``), read at the columns that produced each committed token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

TokenLogprob = tuple[int, float, list[tuple[int, float]]]
"""(token id, its log-probability, the top alternatives as (id, log-probability), most likely first)"""


def context_mask(contexts: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """``[B, V]`` bool: token t occurs in row b's context."""
    mask = torch.zeros(len(contexts), vocab, dtype=torch.bool, device=device)
    for b, ctx in enumerate(contexts):
        if ctx:
            mask[b, torch.tensor(sorted(set(ctx)), dtype=torch.long, device=device)] = True
    return mask


def penalize(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """Apply the repetition penalty where ``seen`` (same shape as ``logits``) is set."""
    scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, scaled, logits)


def penalize_tree(logits: torch.Tensor, contexts: Sequence[Sequence[int]], tokens: torch.Tensor,
                  ancestors: torch.Tensor, penalty: float) -> torch.Tensor:
    """``logits [B, N, V]`` of a verify step; node tokens ``[B, N]``; ``ancestors [B, N, N]`` (self included)."""
    b, n, v = logits.shape
    seen = context_mask(contexts, v, logits.device)[:, None, :].expand(b, n, v)
    onehot = torch.zeros(b, n, v, device=logits.device)
    onehot.scatter_(2, tokens[:, :, None].to(logits.device), 1.0)
    on_path = torch.bmm(ancestors.to(logits.device, torch.float32), onehot) > 0
    return penalize(logits, seen | on_path, penalty)


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """``logits [T, V]`` (raw) that produced ``tokens`` (T of them); the ``top`` most likely alternatives each."""
    if not tokens:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(list(tokens), dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, ids[:, None])[:, 0].cpu().tolist()
    alts: list[list[tuple[int, float]]] = [[] for _ in tokens]
    if top > 0:
        vals, idx = lp.topk(min(top, lp.shape[-1]), dim=-1)
        alts = [list(zip(i, v, strict=True)) for i, v in zip(idx.cpu().tolist(), vals.cpu().tolist(), strict=True)]
    return [(int(t), float(c), a) for t, c, a in zip(tokens, chosen, alts, strict=True)]
