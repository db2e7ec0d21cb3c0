"""Verification of a draft tree against the target: greedy matching and lossless rejection sampling.

Greedy: walk from the root; at each node take the target's argmax and move to the child holding that token; the
argmax at the last node reached is the bonus token. The output is the target's own greedy continuation.

Sampling (temperature > 0): at node ``u`` with target distribution ``p`` (temperature, top-k, min-p, top-p: exactly what
plain sampling uses), try the children in order. Child ``c`` proposed from ``q`` is accepted with probability
``min(1, p(c) / q(c))``; on rejection ``p`` becomes ``normalize(max(p - q, 0))`` and the next child is tried. A
point-mass proposal (tree nodes) has ``q = onehot(c)``: accept with ``p(c)``, else remove ``c`` from ``p``. When no
child is accepted the bonus token is drawn from the current ``p``. Each accept/reject is an exact rejection-sampling
step, so every emitted token is distributed as the target's next-token distribution (Leviathan et al. 2023, Thm 1;
SpecInfer's multi-candidate variant).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eaglenest.speculative.tree import DraftTree


@dataclass
class Acceptance:
    """Per row: accepted columns (root first), the bonus token, and the number of accepted draft tokens."""

    paths: list[list[int]]
    bonus: list[int]

    @property
    def accepted(self) -> list[int]:
        return [len(p) - 1 for p in self.paths]


def target_probs(logits: torch.Tensor, temperature: float, top_p: float, top_k: int = 0,
                 min_p: float = 0.0) -> torch.Tensor:
    """The distribution plain sampling draws from: softmax(logits / T), then top-k, min-p and nucleus filtering
    (vLLM's and SGLang's order); each filter keeps at least the most likely token."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if 0 < top_k < probs.shape[-1]:
        kth = probs.topk(top_k, dim=-1).values[..., -1:]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(-1, keepdim=True)
    if min_p > 0.0:
        floor = min_p * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(probs >= floor, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(-1, keepdim=True)
    if top_p >= 1.0:
        return probs
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)
    keep = sorted_p.cumsum(-1) - sorted_p < top_p
    filtered = torch.zeros_like(probs).scatter(-1, order, sorted_p * keep)
    return filtered / filtered.sum(-1, keepdim=True)


def _children(parents: list[int]) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in parents]
    for col, par in enumerate(parents):
        if par >= 0:
            kids[par].append(col)
    return kids


def accept_greedy(tree: DraftTree, target_logits: torch.Tensor) -> Acceptance:
    """Longest path whose every token is the target's argmax after its parent (``target_logits [B, N, V]``)."""
    best = target_logits.argmax(-1).cpu().tolist()
    tokens = tree.tokens.cpu().tolist()
    parents = tree.parents.cpu().tolist()
    paths, bonus = [], []
    for row in range(len(tokens)):
        kids = _children(parents[row])
        cur, path = 0, [0]
        while True:
            want = best[row][cur]
            nxt = next((c for c in kids[cur] if tokens[row][c] == want), None)
            if nxt is None:
                break
            cur = nxt
            path.append(cur)
        paths.append(path)
        bonus.append(best[row][cur])
    return Acceptance(paths, bonus)


def accept_sampling(
    tree: DraftTree,
    target_logits: torch.Tensor,
    *,
    temperature: float,
    top_p: float,
    token_map: torch.Tensor | None,
    generators: list[torch.Generator | None],
    top_k: int = 0,
    min_p: float = 0.0,
) -> Acceptance:
    """Rejection sampling over the tree (see the module docstring); randomness from each row's own generator."""
    probs = target_probs(target_logits, temperature, top_p, top_k, min_p).cpu()
    tokens = tree.tokens.cpu().tolist()
    parents = tree.parents.cpu().tolist()
    q_all = tree.q.float().cpu() if tree.q is not None else None
    didx = tree.draft_index.cpu().tolist()
    tmap = token_map.cpu() if token_map is not None else None
    paths, bonus = [], []
    for row in range(len(tokens)):
        gen = generators[row]
        kids = _children(parents[row])
        cur, path = 0, [0]
        p = probs[row, 0]
        while True:
            moved = False
            for c in kids[cur]:
                tok = tokens[row][c]
                if q_all is None:  # point mass at tok
                    ratio = float(p[tok])
                else:
                    qc = float(q_all[row, c, didx[row][c]])
                    ratio = float(p[tok]) / qc if qc > 0 else 0.0
                u = float(torch.rand((), generator=gen))
                if u < min(1.0, ratio):
                    cur, moved = c, True
                    path.append(c)
                    p = probs[row, c]
                    break
                p = _residual(p, tok, None if q_all is None else q_all[row, c], tmap)
            if not moved:
                break
        paths.append(path)
        bonus.append(int(torch.multinomial(p, 1, generator=gen).item()))
    return Acceptance(paths, bonus)


def _residual(p: torch.Tensor, tok: int, q_draft: torch.Tensor | None, token_map: torch.Tensor | None) -> torch.Tensor:
    """``normalize(max(p - q, 0))`` with ``q`` a point mass at ``tok`` or a draft-vocab distribution."""
    if q_draft is None:
        r = p.clone()
        r[tok] = 0.0
    else:
        q = torch.zeros_like(p)
        ids = token_map if token_map is not None else torch.arange(q_draft.shape[0])
        q.index_add_(0, ids, q_draft)
        r = (p - q).clamp(min=0.0)
    total = float(r.sum())
    return r / total if total > 0 else p
