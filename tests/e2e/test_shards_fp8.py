"""fp8 hidden-state storage: the shard contract's encoding, and regen -> train on fp8 shards with the tiny target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eaglenest.config import load_config
from eaglenest.contracts.shards import (
    FP8,
    blob_bytes,
    bytes_to_tensor,
    hidden_bytes_per_token,
    read_manifest,
    shard_files,
    tensor_to_bytes,
)

REPO = Path(__file__).resolve().parents[2]


def test_fp8_blob_round_trip_per_state_scales():
    torch.manual_seed(0)
    h = 64
    # three states of very different magnitude in one row: each keeps its own scale
    x = torch.randn(7, 3 * h) * torch.cat([torch.full((h,), 1e-3), torch.full((h,), 1.0), torch.full((h,), 500.0)])
    buf = tensor_to_bytes(x, FP8, states=3)
    assert len(buf) == blob_bytes(FP8, 7, 3 * h, 3) == 7 * (3 * h + 3)
    y = bytes_to_tensor(buf, FP8, 3 * h, states=3)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    for s in range(3):  # e4m3 keeps 3 mantissa bits: <= 2^-4 relative for normal values, + bf16's own rounding
        part, got = x[:, s * h:(s + 1) * h], y[:, s * h:(s + 1) * h].float()
        big = part.abs() > part.abs().amax() * 2 ** -6  # below that e4m3 is subnormal
        assert ((got - part).abs()[big] / part.abs()[big]).max() <= 2 ** -4 + 2 ** -8
    zeros = bytes_to_tensor(tensor_to_bytes(torch.zeros(2, 8), FP8), FP8, 8)
    assert torch.equal(zeros, torch.zeros(2, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="corrupt fp8"):
        bytes_to_tensor(buf[:-1], FP8, 3 * h, states=3)


def test_fp8_halves_the_bytes_per_token():
    assert hidden_bytes_per_token(128, "bfloat16") == 8 * 128
    assert hidden_bytes_per_token(128, FP8) == 4 * 128 + 4 <= 4.1 * 128
    assert hidden_bytes_per_token(7168, FP8) == 4 * 7168 + 4


def test_regen_and_train_on_fp8_shards(ray_session, tmp_path, tiny_engine):
    """regen writes fp8 shards at 4*H + 4 bytes/token with the scale layout in the manifest; training reads them
    (dequantised) and a manifest with an unknown layout is refused with the fix."""
    from eaglenest.contracts.target import TargetSpec
    from eaglenest.drafter.data import DataMismatchError, check_manifest
    from eaglenest.drafter.driver import train_drafter
    from eaglenest.regen.pipeline import run_regen

    cfg = load_config(REPO / "configs" / "demo.yaml", {"regen.storage_dtype": FP8, "train.max_steps": 3,
                                                       "train.eval_every": 3, "train.checkpoint_every": 3})
    out = tmp_path / "regen"
    summary = run_regen(cfg, out, limit=2, log=lambda _: None)
    m = read_manifest(out)
    h = m.hidden_size
    assert m.dtype == FP8 and m.scale_layout == "per_token_state_pow2_int8"
    assert m.bytes_per_token == 4 * h + 4 and summary["num_samples"] > 0
    import pyarrow.parquet as pq

    rows = [r for f in shard_files(out) for r in pq.read_table(f).to_pylist()]
    caps = tiny_engine.capture([r["input_ids"] for r in rows[:3]])
    for r, cap in zip(rows, caps, strict=False):
        aux = bytes_to_tensor(r["aux_hidden_states"], FP8, 3 * h, states=3).float()
        ref = cap.aux_hidden_states.float()
        assert len(r["aux_hidden_states"]) + len(r["last_hidden_state"]) == (4 * h + 4) * r["num_tokens"]
        assert ((aux - ref).norm() / ref.norm()) < 0.05  # the whole tensor within fp8's precision

    result = train_drafter(cfg, out, tmp_path / "train")
    assert (tmp_path / "train" / "export" / "config.json").is_file() and result

    bad = json.loads((out / "manifest.json").read_text())
    bad["scale_layout"] = "per_tensor_fp32"
    (out / "manifest.json").write_text(json.dumps(bad))
    with pytest.raises(DataMismatchError, match="scale layout"):
        check_manifest(read_manifest(out), TargetSpec.read(m.target))
