"""Training never reads the states ``contracts.states.unread_state_positions`` names (capture during generation
stores zeros there), and does read the ones next to them (so this test can fail)."""

from __future__ import annotations

import pytest
import torch

from eaglenest.contracts.states import unread_state_positions
from eaglenest.drafter.batch import pad_batch
from eaglenest.drafter.steps import autocast_for, init_drafter, ttt_forward
from eaglenest.drafters.eagle3.model import DrafterModelConfig
from eaglenest.drafters.eagle3.ttt import TeacherHead, TTTObjective
from eaglenest.drafters.vocab import build_vocab_mapping

H, V, VD, K = 32, 64, 64, 3  # every token in the draft vocab: every masked-in position is trained


def _objective() -> tuple[TeacherHead, TTTObjective]:
    torch.manual_seed(0)
    cfg = DrafterModelConfig(
        hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
        vocab_size=V, draft_vocab_size=VD, aux_layer_ids=[2, 4, 5], target_hidden_size=H, target_num_layers=8,
        rope_theta=100.0, rms_norm_eps=1e-6,
    )
    mapping = build_vocab_mapping(torch.randint(1, 50, (V,)), VD)
    lm_head = torch.randn(V, H)
    drafter = init_drafter(cfg, torch.randn(V, H), lm_head, mapping).double()
    return TeacherHead(lm_head.double(), mapping), TTTObjective(drafter, K, 0.8)


def _loss(samples: list[tuple[list[int], list[int], torch.Tensor, torch.Tensor]]) -> tuple[float, list[float]]:
    teacher, objective = _objective()
    batch = pad_batch(samples, max_seq_len=64).to(torch.device("cpu"), torch.float64)
    out = ttt_forward(batch, teacher, objective, autocast_for(torch.device("cpu")))
    out.loss.backward()
    grads = [float(p.grad.double().norm()) for p in objective.drafter.parameters() if p.grad is not None]
    return float(out.loss.detach()), grads


def _sample(n: int, last_masked: bool, seed: int) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (n,), generator=g).tolist()
    mask = [0] * 4 + [1] * (n - 4)
    if not last_masked:
        mask[-1] = 0
    return ids, mask, torch.randn(n, 3 * H, generator=g, dtype=torch.float64), torch.randn(n, H, generator=g,
                                                                                           dtype=torch.float64)


def _perturbed(sample: tuple, positions: set[int], which: str) -> tuple:
    ids, mask, aux, last = sample
    aux, last = aux.clone(), last.clone()
    for t in positions:
        if which in ("aux", "both"):
            aux[t] = 0.0
        if which in ("last", "both"):
            last[t] = 0.0
    return ids, mask, aux, last


@pytest.mark.parametrize("last_masked", [True, False])
def test_unread_positions_do_not_change_training(last_masked: bool) -> None:
    a, b = _sample(12, last_masked, 1), _sample(9, True, 2)  # b: a shorter neighbour in the padded batch
    unread_a = unread_state_positions(12, a[1])
    assert unread_a == ({11} if last_masked else {10, 11})
    loss, grads = _loss([a, b])
    loss2, grads2 = _loss([_perturbed(a, unread_a, "both"), _perturbed(b, unread_state_positions(9, b[1]), "both")])
    assert loss2 == pytest.approx(loss, rel=1e-12, abs=0)
    assert grads2 == pytest.approx(grads, rel=1e-12, abs=0)


def test_neighbouring_states_are_read() -> None:
    """Controls: the position before the unread ones changes the loss (aux), and so does the final state before a
    masked-in last token (its teacher)."""
    a, b = _sample(12, True, 1), _sample(9, True, 2)
    loss, _ = _loss([a, b])
    assert _loss([_perturbed(a, {9}, "aux"), b])[0] != pytest.approx(loss, rel=1e-9)
    assert _loss([_perturbed(a, {10}, "last"), b])[0] != pytest.approx(loss, rel=1e-9)


def test_empty_and_single_token() -> None:
    assert unread_state_positions(0, []) == frozenset()
    assert unread_state_positions(1, [1]) == {0}
