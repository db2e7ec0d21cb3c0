"""The FlexAttention TTT path and the loss-head kernel against the manual implementation (all on CPU).

FlexAttention runs eagerly here (no compile): its forward is the reference math on the same block mask the compiled
CUDA kernel gets. torch (2.13 at the time of writing) has no FlexAttention backward on CPU, so gradients of the flex
path are checked through the very same key packing and block mask, expanded to a dense mask and fed to SDPA; the
forward test proves flex itself agrees with that mask.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_ttt_reference import make_batch, make_setup, reference_loss

from eaglenest.drafters.eagle3.ttt import (
    ATTENTION_ENV,
    LOSS_ENV,
    TeacherHead,
    TTTObjective,
    resolve_attention,
    resolve_loss,
    soft_cross_entropy,
    soft_cross_entropy_fn,
    ttt_attention,
)
from eaglenest.drafters.eagle3.ttt_flex import (
    SEQ_ALIGN,
    flex_available,
    flex_ttt_attention,
    pack_segments,
    padded_len,
    ttt_block_mask,
)

pytestmark = pytest.mark.skipif(not flex_available(), reason="this torch has no flex_attention")


def mask_mod_dense(mask) -> torch.Tensor:
    """``[Q_LEN, KV_LEN]`` bool: ``mask_mod`` at every element (what eager FlexAttention applies)."""
    q_len, kv_len = mask.seq_lengths
    q = torch.arange(q_len)[:, None]
    kv = torch.arange(kv_len)[None, :]
    return mask.mask_mod(torch.tensor(0), torch.tensor(0), q, kv).expand(q_len, kv_len)


def block_mask_dense(mask) -> torch.Tensor:
    """``[Q_LEN, KV_LEN]`` bool as the compiled kernel applies ``mask``: listed full blocks are all True, listed
    partial blocks take ``mask_mod``, every other block is skipped (False)."""
    q_len, kv_len = mask.seq_lengths
    bq, bkv = mask.BLOCK_SIZE
    elem = mask_mod_dense(mask)
    dense = torch.zeros(q_len, kv_len, dtype=torch.bool)
    for i in range(mask.kv_num_blocks.shape[-1]):
        rows = slice(i * bq, (i + 1) * bq)
        for j in mask.kv_indices[0, 0, i, : int(mask.kv_num_blocks[0, 0, i])].tolist():
            cols = slice(j * bkv, (j + 1) * bkv)
            dense[rows, cols] = elem[rows, cols]
        for j in mask.full_kv_indices[0, 0, i, : int(mask.full_kv_num_blocks[0, 0, i])].tolist():
            dense[rows, j * bkv:(j + 1) * bkv] = True
    return dense


def expected_dense(t: int, tp: int, step: int, kv_blocks: int) -> torch.Tensor:
    """The TTT rule in the packed layout, written out per segment (real query rows only)."""
    out = torch.zeros(t, kv_blocks * tp, dtype=torch.bool)
    for q in range(t):
        out[q, : q + 1] = True  # step-0 keys up to and including the row itself
        for j in range(1, step + 1):
            out[q, j * tp + q] = True  # the same row of step j
    return out


@pytest.mark.parametrize(("t", "step", "kv_blocks"), [(5, 1, 2), (40, 3, 7), (256, 2, 3), (300, 6, 7)])
def test_block_mask_is_the_ttt_rule(t: int, step: int, kv_blocks: int) -> None:
    tp = padded_len(t)
    assert tp % SEQ_ALIGN == 0 and tp >= t
    mask = ttt_block_mask(tp, step, kv_blocks, "cpu")
    assert mask.seq_lengths == (tp, kv_blocks * tp)
    dense = mask_mod_dense(mask)
    assert torch.equal(dense[:t], expected_dense(t, tp, step, kv_blocks))
    # padded query rows never reach the zero segments either, and the block lists agree with mask_mod everywhere
    # (eager and compiled FlexAttention apply the same mask)
    assert not dense[:, (step + 1) * tp:].any()
    assert torch.equal(block_mask_dense(mask), dense)
    # block sparsity: causal blocks of segment 0 plus one diagonal block per later segment, nothing else
    nq = tp // mask.BLOCK_SIZE[0]
    listed = int(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum())
    assert listed == nq * (nq + 1) // 2 + nq * step
    # cached, and every step's mask_mod has the same code (closures differ only in a captured tensor), so one
    # compiled kernel serves all steps of this Tp
    assert ttt_block_mask(tp, step, kv_blocks, "cpu") is mask
    assert ttt_block_mask(tp, 0, kv_blocks, "cpu").mask_mod.__code__ is mask.mask_mod.__code__


def test_block_mask_rejects_bad_layouts() -> None:
    with pytest.raises(ValueError, match="multiple of"):
        ttt_block_mask(100, 1, 2, "cpu")
    with pytest.raises(ValueError, match="kv_blocks"):
        ttt_block_mask(SEQ_ALIGN, 3, 3, "cpu")


def qkv(b: int, h: int, hk: int, t: int, d: int, steps: int, seed: int, grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t, d, generator=g)
    ks = [torch.randn(b, hk, t, d, generator=g) for _ in range(steps + 1)]
    vs = [torch.randn(b, hk, t, d, generator=g) for _ in range(steps + 1)]
    if grad:
        for x in [q, *ks, *vs]:
            x.requires_grad_(True)
    return q, ks, vs


CASES = [  # batch, heads, kv heads, T, step, kv_blocks
    (1, 2, 2, 7, 1, 2),
    (2, 4, 2, 19, 3, 4),  # GQA
    (3, 4, 1, 33, 6, 7),  # MQA, every segment in use (last step of 7)
    (2, 4, 2, 12, 2, 7),  # GQA, four zero segments
    (1, 8, 4, 260, 4, 5),  # T past one SEQ_ALIGN bucket
]


@pytest.mark.parametrize(("b", "h", "hk", "t", "step", "kv_blocks"), CASES)
def test_flex_forward_matches_manual(b: int, h: int, hk: int, t: int, step: int, kv_blocks: int) -> None:
    q, ks, vs = qkv(b, h, hk, t, 16, step, seed=t + step)
    manual = ttt_attention(q, ks[0], vs[0], ks[1:], vs[1:], impl="manual")
    flex = flex_ttt_attention(q, ks[0], vs[0], ks[1:], vs[1:], kv_blocks=kv_blocks, compiled=False)
    assert flex.shape == manual.shape == (b, h, t, 16)
    torch.testing.assert_close(flex, manual, rtol=1e-5, atol=1e-5)
    via_dispatch = ttt_attention(q, ks[0], vs[0], ks[1:], vs[1:], impl="flex", kv_blocks=kv_blocks)
    torch.testing.assert_close(via_dispatch, manual, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("b", "h", "hk", "t", "step", "kv_blocks"), CASES)
def test_packed_mask_gradients_match_manual(b: int, h: int, hk: int, t: int, step: int, kv_blocks: int) -> None:
    """Gradients through the flex path's packing + block mask (dense, via SDPA) equal the manual path's."""
    d = 16
    q, ks, vs = qkv(b, h, hk, t, d, step, seed=100 + t + step, grad=True)
    w = torch.randn(b, h, t, d, generator=torch.Generator().manual_seed(5))
    inputs = [q, *ks, *vs]

    manual = ttt_attention(q, ks[0], vs[0], ks[1:], vs[1:], impl="manual")
    grads_manual = torch.autograd.grad((manual * w).sum(), inputs)

    tp = padded_len(t)
    keys = pack_segments(ks[0], ks[1:], tp, kv_blocks)
    vals = pack_segments(vs[0], vs[1:], tp, kv_blocks)
    dense = block_mask_dense(ttt_block_mask(tp, step, kv_blocks, "cpu"))
    qp = F.pad(q, (0, 0, 0, tp - t))
    out = F.scaled_dot_product_attention(qp, keys, vals, attn_mask=dense, enable_gqa=h != hk)[:, :, :t]
    grads_packed = torch.autograd.grad((out * w).sum(), inputs)

    torch.testing.assert_close(out, manual, rtol=1e-5, atol=1e-5)
    for name, a, r in zip(["q"] + [f"k{i}" for i in range(step + 1)] + [f"v{i}" for i in range(step + 1)],
                          grads_packed, grads_manual, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-5, msg=f"gradient of {name}")


def test_flex_gradients_on_cpu_where_torch_supports_them() -> None:
    """FlexAttention's own backward, where this torch has it on CPU (checked loudly either way)."""
    q, ks, vs = qkv(2, 4, 2, 9, 8, 2, seed=3, grad=True)
    try:
        out = flex_ttt_attention(q, ks[0], vs[0], ks[1:], vs[1:], compiled=False)
    except NotImplementedError as e:
        assert "backward on CPU" in str(e)
        pytest.skip(f"torch {torch.__version__}: FlexAttention has no CPU backward; gradients of the identical "
                    "packing and block mask are checked by test_packed_mask_gradients_match_manual")
    inputs = [q, *ks, *vs]
    got = torch.autograd.grad(out.sum(), inputs)
    ref = torch.autograd.grad(ttt_attention(q, ks[0], vs[0], ks[1:], vs[1:], impl="manual").sum(), inputs)
    for a, r in zip(got, ref, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("steps", "lengths"), [(3, [12, 7, 3]), (7, [12, 2, 9])])
def test_objective_with_flex_matches_reference(steps: int, lengths: list[int]) -> None:
    """The whole TTT forward through FlexAttention (padding, K steps, GQA) equals the loop-by-loop reference."""
    seed = steps * 100 + len(lengths)
    _, drafter, mapping, lm_head = make_setup(seed)
    ids, aux, last, mask, lens = make_batch(lengths, seed)
    targets = TeacherHead(lm_head, mapping)(last, mask, lens)
    with torch.no_grad():
        flex = TTTObjective(drafter, ttt_steps=steps, attention="flex")(ids, aux, targets)
        manual = TTTObjective(drafter, ttt_steps=steps, attention="manual")(ids, aux, targets)
        ref_loss, ref_counts, ref_correct = reference_loss(drafter, lm_head, mapping, ids, aux, last, mask, lens,
                                                           steps, 0.8)
    assert flex.count.tolist() == [float(c) for c in ref_counts]
    assert flex.correct.tolist() == [float(c) for c in ref_correct] == manual.correct.tolist()
    torch.testing.assert_close(flex.loss, ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(flex.ce_sum, manual.ce_sum, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_soft_cross_entropy_is_the_old_formula(dtype: torch.dtype) -> None:
    """The loss-head function computes exactly what the objective computed inline before (bitwise, on CPU)."""
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(2, 11, 50, generator=g)).to(dtype).requires_grad_(True)
    probs = torch.randn(2, 11, 50, generator=g).softmax(-1)
    w = torch.randn(2, 11, generator=g)
    ce, top = soft_cross_entropy(logits, probs)
    (grad,) = torch.autograd.grad((ce * w).sum(), logits)

    old = logits.float()
    ce_old = -(probs * old.log_softmax(-1)).sum(-1)
    (grad_old,) = torch.autograd.grad((ce_old * w).sum(), logits)
    assert ce.dtype == torch.float32 and grad.dtype == dtype
    assert torch.equal(ce, ce_old) and torch.equal(grad, grad_old)
    assert torch.equal(top, old.argmax(-1))


def test_kernel_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv(ATTENTION_ENV, raising=False)
    monkeypatch.delenv(LOSS_ENV, raising=False)
    assert resolve_attention(None, cpu) == "manual" and resolve_attention(None, cuda) == "flex"
    assert resolve_loss(None, cpu) == "eager" and resolve_loss(None, cuda) == "compiled"
    assert soft_cross_entropy_fn(None, cpu) is soft_cross_entropy
    assert resolve_attention("manual", cuda) == "manual" and resolve_attention("flex", cpu) == "flex"
    monkeypatch.setenv(ATTENTION_ENV, "manual")
    monkeypatch.setenv(LOSS_ENV, "eager")
    assert resolve_attention(None, cuda) == "manual" and resolve_loss(None, cuda) == "eager"
    assert resolve_attention("flex", cuda) == "flex"  # an explicit argument beats the environment
    monkeypatch.setenv(ATTENTION_ENV, "fast")
    with pytest.raises(ValueError, match=ATTENTION_ENV):
        resolve_attention(None, cpu)
    _, drafter, _, _ = make_setup(1)
    with pytest.raises(ValueError, match="not one of"):
        TTTObjective(drafter, attention="manual", loss_kernel="fused")
