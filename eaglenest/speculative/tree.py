"""Draft trees: EAGLE-2/SGLang-style top-k expansion, budgeted node selection, and the tree attention mask.

A tree has ``N = num_draft_tokens`` columns per row. Column 0 is the root: the last emitted token, not yet in the
target's KV cache. Columns are ordered by depth, so a parent always precedes its children. Chain drafting is the
``topk == 1`` case (a tree whose every node has one child).

Expansion (``num_steps`` levels): level 1 takes the top-k of the root's draft distribution; every later level feeds
the previous level's ``topk`` frontier nodes through the drafter, scores their ``topk * topk`` children by cumulative
log-probability and keeps the best ``topk`` as the next frontier. All scored candidates compete for the
``N - 1`` node budget; because a child never scores above its parent, the best ``N - 1`` always form a tree.
At temperature > 0 a chain samples each draft token from the drafter's distribution ``q`` (kept for rejection
sampling); a tree (``topk > 1``) uses its deterministic top-k nodes as point-mass proposals.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# step(tokens [B, k] draft ids, parent_hidden [B, k, H], level, allowed_block [B, k, P + k]) -> (logits, hidden)
DraftStepFn = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
ChainMaskFn = Callable[[torch.Tensor | None], torch.Tensor]
"""previous level's draft tokens ``[B]`` (target ids; None at the first level) -> the draft-vocab tokens ``[B, Vd]``
(bool) this level may propose: structured output's grammar, so that a chain proposes what the target may accept"""


@dataclass
class DraftTree:
    """The nodes one verify step checks, per row (``[B, N]`` unless noted)."""

    tokens: torch.Tensor
    """target token ids; column 0 is the root (pending token)"""
    parents: torch.Tensor
    """column of each node's parent; -1 for the root"""
    depth: torch.Tensor
    """0 for the root, 1 for the first draft token, ..."""
    draft_index: torch.Tensor
    """draft-vocab index of each node (root: 0)"""
    ancestors: torch.Tensor
    """``[B, N, N]`` bool: node i may attend to node j (j is i or one of its ancestors)"""
    q: torch.Tensor | None = None
    """``[B, N, Vd]`` the drafter distribution each node was *sampled* from; None: nodes are point-mass proposals"""

    @property
    def size(self) -> int:
        return int(self.tokens.shape[1])


def root_only(pending: torch.Tensor) -> DraftTree:
    """A tree with no draft nodes: one plain decoding step (the baseline uses the same verify path)."""
    b = pending.shape[0]
    zeros = torch.zeros(b, 1, dtype=torch.long, device=pending.device)
    return DraftTree(
        tokens=pending[:, None], parents=zeros - 1, depth=zeros, draft_index=zeros,
        ancestors=torch.ones(b, 1, 1, dtype=torch.bool, device=pending.device),
    )


def ancestor_matrix(parents: torch.Tensor) -> torch.Tensor:
    """``[B, N, N]`` self-or-ancestor relation from parent columns (parents precede children)."""
    b, n = parents.shape
    anc = torch.eye(n, dtype=torch.bool, device=parents.device).expand(b, n, n).clone()
    for i in range(1, n):
        par = parents[:, i].clamp(min=0)
        anc[:, i] |= anc[torch.arange(b, device=parents.device), par]
    return anc


def build_tree(
    *,
    pending: torch.Tensor,
    root_logits: torch.Tensor,
    root_hidden: torch.Tensor,
    step: DraftStepFn,
    token_map: torch.Tensor | None,
    num_steps: int,
    topk: int,
    num_nodes: int,
    temperature: float = 0.0,
    generators: list[torch.Generator | None] | None = None,
    chain_mask: ChainMaskFn | None = None,
) -> DraftTree:
    """Expand and select a draft tree (see the module docstring); ``step`` runs the drafter on frontier nodes.
    ``chain_mask`` (chains only): the draft tokens each level may propose, given the previous level's."""
    b, vd = root_logits.shape
    dev = root_logits.device
    k = min(topk, vd)
    sample_chain = temperature > 0 and k == 1

    def to_target(idx: torch.Tensor) -> torch.Tensor:
        return idx if token_map is None else token_map[idx]

    c_idx: list[torch.Tensor] = []
    c_score: list[torch.Tensor] = []
    c_parent: list[torch.Tensor] = []
    c_depth: list[int] = []
    c_q: list[torch.Tensor] = []

    masking = chain_mask is not None and k == 1

    def pick(logits: torch.Tensor, prev: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``logits [B, m, Vd]`` -> (scores, indices ``[B, m, k]``, q ``[B, m, Vd]`` when sampling)."""
        lg = logits.float()
        if masking:
            allowed = chain_mask(prev)  # type: ignore[misc]
            lg = lg.masked_fill(~allowed[:, None, :].to(lg.device), float("-inf"))
        if sample_chain:
            q = torch.softmax(lg / temperature, dim=-1)
            idx = _multinomial_rows(q[:, 0], generators)[:, None, None]
            return torch.zeros(idx.shape, device=dev), idx, q
        vals, idx = torch.topk(torch.log_softmax(lg, dim=-1), k, dim=-1)
        return vals, idx, None

    vals, idx, q = pick(root_logits[:, None])
    fr_score, fr_idx = vals[:, 0], idx[:, 0]  # [B, k]
    c_idx.append(fr_idx)
    c_score.append(fr_score)
    c_parent.append(torch.full((b, k), -1, dtype=torch.long, device=dev))
    c_depth += [1] * k
    if q is not None:
        c_q.append(q)
    fr_ids = torch.arange(k, device=dev).expand(b, k)
    fr_hidden = root_hidden[:, None].expand(b, k, root_hidden.shape[-1])
    fr_anc = torch.zeros(b, k, 0, dtype=torch.bool, device=dev)
    eye = torch.eye(k, dtype=torch.bool, device=dev).expand(b, k, k)
    n_cand = k
    for level in range(2, num_steps + 1):
        logits, hidden = step(to_target(fr_idx), fr_hidden, level, torch.cat([fr_anc, eye], dim=2))
        vals, idx, q = pick(logits, to_target(fr_idx[:, 0]) if masking else None)  # [B, k, k]
        scores = (fr_score[:, :, None] + vals).reshape(b, k * k)
        flat_idx = idx.reshape(b, k * k)
        c_idx.append(flat_idx)
        c_score.append(scores)
        c_parent.append(fr_ids[:, :, None].expand(b, k, k).reshape(b, k * k))
        c_depth += [level] * (k * k)
        if q is not None:
            c_q.append(q)
        r = scores.topk(k, dim=-1).indices if k > 1 else torch.zeros(b, 1, dtype=torch.long, device=dev)
        prow = r // k
        fr_ids = n_cand + r
        fr_idx = flat_idx.gather(1, r)
        fr_score = scores.gather(1, r)
        fr_hidden = hidden.gather(1, prow[:, :, None].expand(b, k, hidden.shape[-1]))
        prev = fr_anc.gather(1, prow[:, :, None].expand(b, k, fr_anc.shape[2]))
        fr_anc = torch.cat([prev, torch.nn.functional.one_hot(prow, k).bool()], dim=2)
        n_cand += k * k

    cand_idx = torch.cat(c_idx, dim=1)
    cand_score = torch.cat(c_score, dim=1)
    cand_parent = torch.cat(c_parent, dim=1)
    cand_depth = torch.tensor(c_depth, device=dev)
    budget = min(num_nodes - 1, n_cand)
    if budget == n_cand:
        sel = torch.arange(n_cand, device=dev).expand(b, n_cand)
    else:  # stable: on equal scores the shallower candidate (appended first) wins, so parents come first
        order = torch.sort(cand_score, dim=1, descending=True, stable=True).indices[:, :budget]
        sel = torch.sort(order, dim=1).values  # candidate order = depth order
    col_of = torch.zeros(b, n_cand, dtype=torch.long, device=dev)
    col_of.scatter_(1, sel, torch.arange(1, budget + 1, device=dev).expand(b, budget))
    par_c = cand_parent.gather(1, sel)
    par_col = torch.where(par_c < 0, torch.zeros_like(par_c), col_of.gather(1, par_c.clamp(min=0)))
    if bool((par_col.eq(0) & par_c.ge(0)).any()):
        raise RuntimeError("draft tree selection dropped a parent; scores must not increase along a path")
    node_idx = cand_idx.gather(1, sel)
    zeros = torch.zeros(b, 1, dtype=torch.long, device=dev)
    parents = torch.cat([zeros - 1, par_col], dim=1)
    tree_q = None
    if c_q:
        qs = torch.cat(c_q, dim=1)  # chain: one q per level, [B, S, Vd]
        tree_q = torch.cat([qs[:, :1], qs], dim=1)  # column 0 (root) is never checked
    return DraftTree(
        tokens=torch.cat([pending[:, None], to_target(node_idx)], dim=1),
        parents=parents,
        depth=torch.cat([zeros, cand_depth[sel]], dim=1),
        draft_index=torch.cat([zeros, node_idx], dim=1),
        ancestors=ancestor_matrix(parents),
        q=tree_q,
    )


def _multinomial_rows(probs: torch.Tensor, generators: list[torch.Generator | None] | None) -> torch.Tensor:
    """One sample per row of ``probs [B, V]``, each row with its own CPU generator (reproducible per request)."""
    cpu = probs.float().cpu()
    out = [
        int(torch.multinomial(cpu[i], 1, generator=(generators[i] if generators else None)).item())
        for i in range(cpu.shape[0])
    ]
    return torch.tensor(out, dtype=torch.long, device=probs.device)
