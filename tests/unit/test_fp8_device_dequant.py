"""fp8 shards dequantised in the training step (on the batch's device) instead of in collation on the host.

On a CPU-only machine both paths run on the CPU from the same bytes; the device path is the same code the GPU runs
(:meth:`Batch.to` -> ``contracts.shards.dequantize_fp8``), so bit equality here is bit equality of the two
formulas. No Ray, no target model: a small random drafter.
"""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch

from eaglenest.contracts.shards import (
    FP8,
    FP8_SCALE_LAYOUT,
    Manifest,
    bytes_to_tensor,
    dequantize_fp8,
    fp8_parts,
    tensor_to_bytes,
)
from eaglenest.contracts.target import TargetSpec
from eaglenest.drafter.batch import pad_batch
from eaglenest.drafter.data import DataMismatchError, check_manifest, collate
from eaglenest.drafter.loop import Cadence, Parts, TrainState, train_loop
from eaglenest.drafter.steps import autocast_for, init_drafter, make_optimizer, ttt_forward
from eaglenest.drafters.eagle3.model import DrafterModelConfig
from eaglenest.drafters.eagle3.ttt import TeacherHead, TTTObjective
from eaglenest.drafters.vocab import build_vocab_mapping

H, V, VD = 32, 64, 24


def _states(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """aux [n, 3H] with the three states at very different magnitudes, last [n, H]."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.cat([torch.full((H,), 1e-3), torch.full((H,), 1.0), torch.full((H,), 300.0)])
    return torch.randn(n, 3 * H, generator=g) * scale, torch.randn(n, H, generator=g) * 4.0


def _table(lengths: list[int], seed: int = 0) -> pa.Table:
    rows = []
    for i, n in enumerate(lengths):
        aux, last = _states(n, seed + i)
        rows.append({"id": f"s{i}", "input_ids": [(7 * i + j) % V for j in range(n)],
                     "loss_mask": [0, 0] + [1] * (n - 2),
                     "aux_hidden_states": tensor_to_bytes(aux, FP8, states=3),
                     "last_hidden_state": tensor_to_bytes(last, FP8)})
    return pa.Table.from_pylist(rows)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16) if t.dtype == torch.bfloat16 else t.contiguous().view(torch.int32)


def test_dequantize_is_the_old_formula_bit_for_bit() -> None:
    """Every e4m3 bit pattern (NaN aside) times every int8 exponent: the bit-built scale equals exp2 exactly."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = ~torch.isnan(values.view(torch.float8_e4m3fn).float())
    values = values[finite]
    exps = torch.arange(-128, 128, dtype=torch.int32).to(torch.int8)
    q = values.repeat(len(exps), 1)  # [256 exponents, finite patterns], one state per row
    e = exps.view(-1, 1)
    old = (q.view(torch.float8_e4m3fn).float() * torch.exp2(e.float())).to(torch.bfloat16)
    assert torch.equal(_bits(dequantize_fp8(q, e)), _bits(old))
    assert torch.equal(_bits(dequantize_fp8(q.view(torch.float8_e4m3fn), e)), _bits(old))  # fp8 payloads too


def test_parts_then_dequantize_is_bytes_to_tensor() -> None:
    aux, _ = _states(9, seed=3)
    buf = tensor_to_bytes(aux, FP8, states=3)
    values, exps = fp8_parts(buf, 3 * H, states=3)
    assert values.dtype == torch.uint8 and values.shape == (9, 3 * H)
    assert exps.dtype == torch.int8 and exps.shape == (9, 3)
    assert values.numel() + exps.numel() == len(buf)  # the payload moves at 1 byte per value
    assert torch.equal(_bits(dequantize_fp8(values, exps)), _bits(bytes_to_tensor(buf, FP8, 3 * H, states=3)))
    with pytest.raises(ValueError, match="corrupt fp8"):
        fp8_parts(buf[:-1], 3 * H, states=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_device_path_equals_host_path(dtype: torch.dtype) -> None:
    """collate keeps fp8 + exponents; Batch.to dequantises: the same bits as decoding every row on the host first."""
    lengths, max_len = [5, 9, 3], 8
    table = _table(lengths)
    b = collate(table, dtype=FP8, hidden_size=H, max_seq_len=max_len)
    assert b.quantized and b.aux.dtype == torch.uint8 and b.last.dtype == torch.uint8
    assert b.aux_exponents.shape == (3, 8, 3) and b.last_exponents.shape == (3, 8, 1)
    device_path = b.to("cpu", dtype)
    assert not device_path.quantized and device_path.aux.dtype == dtype

    host_rows = [(r["input_ids"], r["loss_mask"], bytes_to_tensor(r["aux_hidden_states"], FP8, 3 * H, states=3),
                  bytes_to_tensor(r["last_hidden_state"], FP8, H)) for r in table.to_pylist()]
    host_path = pad_batch(host_rows, max_seq_len=max_len).to("cpu", dtype)
    assert torch.equal(_bits(device_path.aux), _bits(host_path.aux))  # padding included (0 -> +0.0)
    assert torch.equal(_bits(device_path.last), _bits(host_path.last))
    assert torch.equal(device_path.input_ids, host_path.input_ids)
    assert torch.equal(device_path.loss_mask, host_path.loss_mask)
    assert device_path.lengths.tolist() == [5, 8, 3]


def test_float_shards_are_collated_as_before() -> None:
    aux, last = _states(4, seed=1)
    table = pa.Table.from_pylist([{"id": "a", "input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 1],
                                   "aux_hidden_states": tensor_to_bytes(aux, "bfloat16"),
                                   "last_hidden_state": tensor_to_bytes(last, "bfloat16")}])
    b = collate(table, dtype="bfloat16", hidden_size=H, max_seq_len=16)
    assert not b.quantized and b.aux.dtype == torch.bfloat16
    assert torch.equal(b.to("cpu").aux[0], aux.to(torch.bfloat16))


def test_collated_fp8_batch_trains_a_step() -> None:
    torch.manual_seed(0)
    cfg = DrafterModelConfig(
        hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
        vocab_size=V, draft_vocab_size=VD, aux_layer_ids=[2, 4, 5], target_hidden_size=H, target_num_layers=8,
        rope_theta=100.0, rms_norm_eps=1e-6,
    )
    mapping = build_vocab_mapping(torch.randint(1, 50, (V,)), VD)
    lm_head = torch.randn(V, H) * 0.1
    drafter = init_drafter(cfg, torch.randn(V, H), lm_head, mapping)
    teacher = TeacherHead(lm_head, mapping)
    objective = TTTObjective(drafter, 3, 0.8)
    params = [p for p in drafter.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    opt = make_optimizer(params, lr=1e-3, weight_decay=0.0)

    device = torch.device("cpu")
    batch = collate(_table([6, 10]), dtype=FP8, hidden_size=H, max_seq_len=16).to(device, torch.float32)
    out = ttt_forward(batch, teacher, objective, autocast_for(device))
    assert torch.isfinite(out.loss)

    records: list[dict] = []

    class Sinks:  # the loop's records, no checkpoints
        log = staticmethod(records.append)

        def checkpoint(self, state: TrainState) -> None:
            pass

        def nonfinite(self) -> None:
            pass

    parts = Parts(model=objective, objective=objective, teacher=teacher, params=params, optimizer=opt,
                  scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), device=device, dtype=torch.float32)
    train_loop(parts, [_table([6, 10])], lambda t: collate(t, dtype=FP8, hidden_size=H, max_seq_len=16), TrainState(),
               Cadence(total_steps=1, stop_at_total=True, log_every=1, eval_every=0, checkpoint_every=0,
                       max_grad_norm=0.5), Sinks())
    assert any(not torch.equal(p, q) for p, q in zip(params, before, strict=True))
    assert [r["step"] for r in records] == [1] and records[0]["nonfinite_steps"] == 0


def test_unknown_scale_layout_is_refused() -> None:
    target = TargetSpec(num_layers=8, hidden_size=H, vocab_size=V, path="/t")
    base = dict(target="t", num_layers=8, hidden_size=H, vocab_size=V, aux_layer_ids=[2, 4, 5], dtype=FP8,
                engine="hf", engine_version="x", num_samples=3)
    check_manifest(Manifest(**base, scale_layout=FP8_SCALE_LAYOUT), target)
    with pytest.raises(DataMismatchError, match="scale layout 'per_tensor_fp32'"):
        check_manifest(Manifest(**base, scale_layout="per_tensor_fp32"), target)
    with pytest.raises(DataMismatchError, match="scale layout None"):
        check_manifest(Manifest(**base), target)
