"""The GPU script's capture-parity step: stored states vs a reference capture, judged after the same storage round
trip, with a one-layer-off control that must fail."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("e2e_parity", ROOT / "benchmarks" / "e2e_parity.py")
e2e_parity = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(e2e_parity)

H, T = 16, 12


def _layers(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(T, H, generator=g) for _ in range(6)]


def _capture(layers: list[torch.Tensor], taps: list[int]) -> SimpleNamespace:
    return SimpleNamespace(aux_hidden_states=torch.cat([layers[k] for k in taps], dim=-1), last_hidden_state=layers[-1])


def _stored(cap: SimpleNamespace, dtype: str, noise: float = 0.0) -> dict:
    g = torch.Generator().manual_seed(7)
    aux = cap.aux_hidden_states * (1 + noise * torch.randn(cap.aux_hidden_states.shape, generator=g))
    return {"input_ids": list(range(T)), "loss_mask": [0] * 4 + [1] * (T - 4),
            "aux": e2e_parity.as_stored(aux, dtype, 3), "last": e2e_parity.as_stored(cap.last_hidden_state, dtype, 1)}


def test_fp8_storage_alone_passes_and_the_control_fails() -> None:
    layers = _layers(0)
    ref, off = _capture(layers, [1, 2, 3]), _capture(layers, [2, 3, 4])
    got = e2e_parity.compare([_stored(ref, "float8_e4m3fn")], [ref], [off], "float8_e4m3fn")
    assert got["ok"] and got["aux"] == 0.0 and got["last"] == 0.0
    assert 0.005 < got["aux_raw"] < 0.06  # what fp8 itself costs, reported beside the judged figure
    assert got["control_aux"] > 0.5


def test_states_off_by_more_than_bf16_rounding_fail() -> None:
    layers = _layers(1)
    ref, off = _capture(layers, [1, 2, 3]), _capture(layers, [2, 3, 4])
    got = e2e_parity.compare([_stored(ref, "bfloat16", noise=0.1)], [ref], [off], "bfloat16")
    assert not got["ok"] and got["aux"] > e2e_parity.TOLERANCE


def test_a_tap_off_by_one_fails_even_when_the_values_match_the_wrong_layer() -> None:
    layers = _layers(2)
    ref, off = _capture(layers, [1, 2, 3]), _capture(layers, [2, 3, 4])
    stored = _stored(off, "bfloat16")  # what an off-by-one recorder would have stored
    got = e2e_parity.compare([stored], [ref], [off], "bfloat16")
    assert not got["ok"] and got["control_aux"] == 0.0 and got["aux"] > 0.5


def test_generation_check_judges_the_read_positions_and_the_controls_smallest_error() -> None:
    """gpu_sglang.states_vs_prefill (the generation-capture checks') shares compare's reduction: the worst recorded
    error, the control's best, positions training never reads left out."""
    import benchmarks.gpu_sglang as gpu_sglang

    layers = [_layers(3), _layers(4)]

    class Prefill:  # what SGLangCaptureRunner.capture returns for the taps asked, per sequence
        def capture(self, seqs: list[list[int]], taps: list[int]) -> list[SimpleNamespace]:
            return [_capture(layers[i], taps) for i in range(len(seqs))]

    caps = [_capture(lay, [1, 2, 3]) for lay in layers]
    mask = [0] * 4 + [1] * (T - 4)
    read = gpu_sglang.read_positions(T, mask)
    unread = sorted(set(range(T)) - set(read))
    assert unread  # the last position's states are never read: corrupting them must not count
    caps[1].aux_hidden_states[unread] = 1e6
    worst = gpu_sglang.states_vs_prefill(Prefill(), [1, 2, 3], [list(range(T))] * 2, [mask] * 2, caps)
    assert worst["aux"] == 0.0 and worst["last"] == 0.0 and worst["control_aux"] > 0.5
    caps[0].aux_hidden_states[read[0]] += 1.0
    assert gpu_sglang.states_vs_prefill(Prefill(), [1, 2, 3], [list(range(T))] * 2, [mask] * 2, caps)["aux"] > 0
