"""The batched TTT loss against a plain reference: one sample, one step, one position, one head at a time.

The reference sees only each sample's real tokens (no padding, no masks), builds every attention key list
explicitly, applies RoPE from its own formula, and computes each target from the teacher head row by row.
"""

from __future__ import annotations

import math

import pytest
import torch

from eaglenest.drafters.eagle3.model import DrafterModelConfig, Eagle3Drafter
from eaglenest.drafters.eagle3.ttt import TeacherHead, TTTObjective, step_metrics
from eaglenest.drafters.vocab import build_vocab_mapping

H, HEADS, KV, D, V, VD = 32, 4, 2, 8, 64, 24


def make_setup(seed: int, kv: int = KV):
    torch.manual_seed(seed)
    cfg = DrafterModelConfig(
        hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=kv, head_dim=D, intermediate_size=48,
        vocab_size=V, draft_vocab_size=VD, aux_layer_ids=[2, 4, 5], target_hidden_size=H, target_num_layers=8,
        rope_theta=100.0, rms_norm_eps=1e-6,
    )
    counts = torch.randint(0, 50, (V,))
    mapping = build_vocab_mapping(counts, VD)
    lm_head = torch.randn(V, H)
    lm_head[mapping.draft_ids] *= 1.6  # most (not all) target argmaxes fall inside the draft vocab
    drafter = Eagle3Drafter(cfg)
    drafter.init_from_target(torch.randn(V, H), lm_head, mapping.d2t, mapping.t2d)
    with torch.no_grad():  # non-trivial norm weights so a swapped norm would show
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
    return cfg, drafter, mapping, lm_head


def make_batch(lengths: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    b, t = len(lengths), max(lengths)
    ids = torch.zeros(b, t, dtype=torch.long)
    aux = torch.zeros(b, t, 3 * H)
    last = torch.zeros(b, t, H)
    mask = torch.zeros(b, t, dtype=torch.int8)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(0, V, (n,), generator=g)
        aux[i, :n] = torch.randn(n, 3 * H, generator=g)
        last[i, :n] = torch.randn(n, H, generator=g)
        mask[i, :n] = (torch.rand(n, generator=g) < 0.8).to(torch.int8)
        mask[i, :2] = 0  # a prompt
    return ids, aux, last, mask, torch.tensor(lengths)


def rope(x: torch.Tensor, pos: int, theta: float) -> torch.Tensor:
    """Neox RoPE for one vector of one head: pairs (i, i + d/2) rotated by pos * theta^(-2i/d)."""
    d = x.numel()
    out = x.clone()
    for i in range(d // 2):
        ang = pos * theta ** (-2 * i / d)
        c, s = math.cos(ang), math.sin(ang)
        a, b = x[i], x[i + d // 2]
        out[i] = a * c - b * s
        out[i + d // 2] = b * c + a * s
    return out


def reference_loss(drafter: Eagle3Drafter, lm_head, mapping, ids, aux, last, mask, lengths, steps, decay):
    layer, attn = drafter.midlayer, drafter.midlayer.self_attn
    theta = drafter.config.rope_theta
    kv_heads = drafter.config.num_key_value_heads
    group = HEADS // kv_heads
    draft_ids = mapping.draft_ids.tolist()
    ce_terms = [[] for _ in range(steps)]
    correct = [0] * steps
    for b in range(ids.shape[0]):
        n = int(lengths[b])
        x = ids[b, :n].tolist()
        prev = [drafter.fc(aux[b, t]) for t in range(n)]
        keys: dict[tuple[int, int], list[torch.Tensor]] = {}
        vals: dict[tuple[int, int], list[torch.Tensor]] = {}
        for k in range(steps):
            new = {}
            for t in range(n):
                if t + 1 + k >= n:  # no ground-truth input token left for this row
                    break
                e = drafter.embed_tokens.weight[x[t + 1 + k]]
                u = torch.cat([layer.input_layernorm(e), layer.hidden_norm(prev[t])])
                q = attn.q_proj(u).view(HEADS, D)
                kk = attn.k_proj(u).view(kv_heads, D)
                vv = attn.v_proj(u).view(kv_heads, D)
                keys[(k, t)] = [rope(kk[j], t + k, theta) for j in range(kv_heads)]
                vals[(k, t)] = [vv[j] for j in range(kv_heads)]
                heads = []
                for hd in range(HEADS):
                    kvh = hd // group
                    qh = rope(q[hd], t + k, theta)
                    klist = [keys[(0, s)][kvh] for s in range(t + 1)] + [keys[(j, t)][kvh] for j in range(1, k + 1)]
                    vlist = [vals[(0, s)][kvh] for s in range(t + 1)] + [vals[(j, t)][kvh] for j in range(1, k + 1)]
                    scores = torch.stack([qh @ kj for kj in klist]) / math.sqrt(D)
                    w = torch.softmax(scores, dim=0)
                    heads.append(sum(wi * vj for wi, vj in zip(w, vlist, strict=True)))
                o = attn.o_proj(torch.cat(heads))
                h = prev[t] + o
                h = h + layer.mlp(layer.post_attention_layernorm(h))
                new[t] = h
                # target: distribution at position t+1+k, counted iff x[t+2+k] exists and is loss-masked
                j = t + 1 + k
                if j + 1 >= n or not mask[b, j + 1]:
                    continue
                tl = lm_head @ last[b, j]
                top = int(tl.argmax())
                if top not in draft_ids:
                    continue
                p = torch.softmax(tl[draft_ids], dim=0)
                logits = drafter.lm_head(drafter.norm(h))
                ce_terms[k].append(-(p * torch.log_softmax(logits, dim=0)).sum())
                correct[k] += int(int(logits.argmax()) == draft_ids.index(top))
            prev = [new.get(t, prev[t]) for t in range(n)]
    loss = torch.zeros(())
    for k in range(steps):
        if ce_terms[k]:
            loss = loss + decay**k * torch.stack(ce_terms[k]).sum() / len(ce_terms[k])
    counts = [len(c) for c in ce_terms]
    return loss, counts, correct


CASES = [  # (K, sequence lengths of the batch, kv heads: 2 = grouped-query, 4 = one kv head per head, 1 = MQA)
    (1, [10], 2),
    (2, [9, 4], 4),
    (3, [12, 7, 3], 2),
    (7, [11, 11], 2),
    (7, [12, 2, 9], 4),
    (4, [6, 12, 12, 5], 1),
]


@pytest.mark.parametrize(("steps", "lengths", "kv"), CASES)
def test_fast_ttt_matches_reference(steps: int, lengths: list[int], kv: int) -> None:
    seed = steps * 100 + len(lengths)
    _, drafter, mapping, lm_head = make_setup(seed, kv)
    ids, aux, last, mask, lens = make_batch(lengths, seed)
    decay = 0.8

    teacher = TeacherHead(lm_head, mapping)
    objective = TTTObjective(drafter, ttt_steps=steps, decay=decay)
    out = objective(ids, aux, teacher(last, mask, lens))
    drafter.zero_grad()
    out.loss.backward()
    fast_grads = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.requires_grad}

    drafter.zero_grad()
    ref_loss, ref_counts, ref_correct = reference_loss(drafter, lm_head, mapping, ids, aux, last, mask, lens,
                                                       steps, decay)
    assert sum(ref_counts) > 0 or max(lengths) <= 3, "the case should supervise something"
    ref_loss.backward()

    assert out.count.tolist() == [float(c) for c in ref_counts]
    assert out.correct.tolist() == [float(c) for c in ref_correct]
    torch.testing.assert_close(out.loss, ref_loss, rtol=1e-5, atol=1e-5)
    for name, p in drafter.named_parameters():
        if not p.requires_grad:
            continue
        scale = float(p.grad.abs().max())  # fp32 rounding grows with the tensor's gradient magnitude
        torch.testing.assert_close(fast_grads[name], p.grad, rtol=1e-4, atol=1e-6 + 4e-6 * scale,
                                   msg=f"gradient of {name}")


def test_padding_does_not_change_a_sample() -> None:
    """The same sample alone and right-padded next to a longer one gives the same per-step sums."""
    _, drafter, mapping, lm_head = make_setup(7)
    teacher = TeacherHead(lm_head, mapping)
    objective = TTTObjective(drafter, ttt_steps=3)
    ids, aux, last, mask, lens = make_batch([12, 6], 3)
    both = objective(ids, aux, teacher(last, mask, lens))
    n = 6
    alone = objective(ids[1:, :n], aux[1:, :n], teacher(last[1:, :n], mask[1:, :n], lens[1:]))
    first = objective(ids[:1], aux[:1], teacher(last[:1], mask[:1], lens[:1]))
    torch.testing.assert_close(both.ce_sum, alone.ce_sum + first.ce_sum, rtol=1e-5, atol=1e-5)
    assert torch.equal(both.count, alone.count + first.count)


def test_step_metrics_accept_length() -> None:
    m = step_metrics(torch.tensor([2.0, 4.0, 6.0]), torch.tensor([8.0, 5.0, 2.0]), torch.tensor([10.0, 10.0, 10.0]))
    assert m["acc_0"] == pytest.approx(0.8) and m["loss_2"] == pytest.approx(0.6)
    assert m["sim_accept_length"] == pytest.approx(1 + 0.8 + 0.8 * 0.5 + 0.8 * 0.5 * 0.2)
    assert m["sim_accept_chain"] == m["sim_accept_length"]  # three TTT steps: the whole 3-step chain
    deeper = step_metrics(torch.ones(5), torch.tensor([8.0, 5.0, 2.0, 9.0, 9.0]), torch.full((5,), 10.0))
    assert deeper["sim_accept_chain"] == pytest.approx(1 + 0.8 + 0.8 * 0.5 + 0.8 * 0.5 * 0.2)
    assert deeper["sim_accept_length"] > deeper["sim_accept_chain"]  # the 4th and 5th steps the engine never drafts
