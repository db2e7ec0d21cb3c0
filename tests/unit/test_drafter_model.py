"""The drafter's inference API: incremental steps with a rollback KV cache and explicit (tree) masks."""

from __future__ import annotations

import pytest
import torch

from eaglenest.drafters.eagle3.model import DrafterModelConfig, Eagle3Drafter


def small_drafter(seed: int = 0, kv: int = 2) -> Eagle3Drafter:
    torch.manual_seed(seed)
    cfg = DrafterModelConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=kv, head_dim=8, intermediate_size=64,
        vocab_size=100, draft_vocab_size=40, aux_layer_ids=[2, 4, 5], target_hidden_size=32, target_num_layers=8,
        rope_theta=500.0,
    )
    m = Eagle3Drafter(cfg).double()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(0.2 * torch.randn_like(p))
    return m.eval()


def inputs(b: int, s: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 100, (b, s), generator=g), torch.randn(b, s, 96, generator=g, dtype=torch.double),
            torch.arange(s).expand(b, s))


def test_incremental_steps_match_one_full_pass() -> None:
    m = small_drafter()
    ids, aux, pos = inputs(2, 7)
    full_logits, full_hidden = m.step(ids, aux, pos, m.new_cache())
    cache = m.new_cache()
    parts = [m.step(ids[:, :3], aux[:, :3], pos[:, :3], cache)]
    for t in range(3, 7):
        parts.append(m.step(ids[:, t:t + 1], aux[:, t:t + 1], pos[:, t:t + 1], cache))
    torch.testing.assert_close(torch.cat([p[0] for p in parts], 1), full_logits)
    torch.testing.assert_close(torch.cat([p[1] for p in parts], 1), full_hidden)
    assert cache.length == 7 and full_logits.shape == (2, 7, 40) and full_hidden.shape == (2, 7, 32)


def test_rollback_then_redraft_equals_fresh_run() -> None:
    """Draft 3 tokens from the drafter's own hidden state, roll back 2, re-draft: same as never drafting them."""
    m = small_drafter()
    ids, aux, pos = inputs(1, 5)
    cache = m.new_cache()
    _, h = m.step(ids, aux, pos, cache)
    hidden, tok = h[:, -1:], torch.tensor([[7]])
    for k in range(3):  # chain drafting: own hidden (H wide, no fc) + drafted token
        logits, hidden = m.step(tok, hidden, torch.tensor([[5 + k]]), cache)
        tok = m.to_target_ids(logits.argmax(-1))
    assert cache.length == 8
    cache.truncate(6)
    again = m.step(torch.tensor([[9]]), h[:, -1:] * 0 + 1.0, torch.tensor([[6]]), cache)
    fresh = m.new_cache()
    m.step(ids, aux, pos, fresh)
    _, h1 = m.step(torch.tensor([[7]]), h[:, -1:], torch.tensor([[5]]), fresh)
    ref = m.step(torch.tensor([[9]]), h[:, -1:] * 0 + 1.0, torch.tensor([[6]]), fresh)
    torch.testing.assert_close(again[0], ref[0])
    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(99)


@pytest.mark.parametrize("kv", [4, 2, 1])
def test_tree_mask_equals_separate_chains(kv: int) -> None:
    """Two sibling branches in one call with a tree mask give what each branch gives alone."""
    m = small_drafter(kv=kv)
    ids, aux, pos = inputs(1, 4)
    cache = m.new_cache()
    _, h = m.step(ids, aux, pos, cache)
    base = h[:, -1:]
    toks = torch.tensor([[11, 12]])
    tree_mask = torch.ones(2, 6, dtype=torch.bool)
    tree_mask[0, 5] = False  # branch 0 does not see branch 1 (and vice versa)
    tree_mask[1, 4] = False
    tree = m.step(toks, base.expand(1, 2, 32), torch.tensor([[4, 4]]), cache.clone(), attention_mask=tree_mask)
    additive = torch.zeros(1, 2, 6, dtype=torch.double).masked_fill(~tree_mask, float("-inf"))
    tree_add = m.step(toks, base.expand(1, 2, 32), torch.tensor([[4, 4]]), cache.clone(), attention_mask=additive)
    for j in range(2):
        alone = m.step(toks[:, j:j + 1], base, torch.tensor([[4]]), cache.clone())
        torch.testing.assert_close(tree[0][:, j:j + 1], alone[0])
        torch.testing.assert_close(tree_add[1][:, j:j + 1], alone[1])
    c = cache.clone()
    m.step(toks, base.expand(1, 2, 32), torch.tensor([[4, 4]]), c, attention_mask=tree_mask)
    c.keep([0, 1, 2, 3, 5])  # accept branch 1 only
    assert c.length == 5
    with pytest.raises(ValueError, match="attention_mask"):
        m.step(toks, base.expand(1, 2, 32), torch.tensor([[4, 4]]), cache.clone(), attention_mask=tree_mask[:, :5])


def test_hidden_width_decides_fc_and_vocab_helpers() -> None:
    m = small_drafter()
    with pytest.raises(ValueError, match="neither"):
        m.step(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, 50, dtype=torch.double),
               torch.zeros(1, 1, dtype=torch.long))
    d2t = torch.arange(40) * 1  # draft i -> target 2i
    t2d = torch.zeros(100, dtype=torch.bool)
    t2d[torch.arange(40) * 2] = True
    m.set_vocab_mapping(d2t, t2d)
    assert m.to_target_ids(torch.tensor([0, 3, 39])).tolist() == [0, 6, 78]
    full = m.full_vocab_logits(torch.arange(40, dtype=torch.double)[None])
    assert full.shape == (1, 100) and full[0, 78] == 39 and torch.isinf(full[0, 1])


def test_rope_matches_transformers_llama() -> None:
    """Same rotation as transformers' Llama (and SGLang's neox-style rope) for the same theta and positions."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    m = small_drafter()
    attn = m.midlayer.self_attn
    x = torch.randn(1, 5, 64, dtype=torch.double)
    pos = torch.tensor([[0, 3, 7, 100, 2047]])
    q, k, _ = attn.qkv(x, pos)
    hf_cfg = LlamaConfig(hidden_size=32, num_attention_heads=4, head_dim=8, rope_theta=500.0,
                         max_position_embeddings=4096)
    rot = LlamaRotaryEmbedding(hf_cfg)
    raw_q = attn.q_proj(x).view(1, 5, 4, 8).transpose(1, 2)
    raw_k = attn.k_proj(x).view(1, 5, 2, 8).transpose(1, 2)
    cos, sin = rot(raw_q.float(), pos)
    rq, rk = apply_rotary_pos_emb(raw_q, raw_k, cos.double(), sin.double())
    torch.testing.assert_close(q, rq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, rk, rtol=1e-5, atol=1e-5)
