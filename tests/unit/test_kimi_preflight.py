"""Preflight of configs/kimi-k25.yaml's drafter against a Kimi-K2.5-shaped target, at full size, without GBs on disk.

The drafter folder is what `eaglenest train` would export for that config (config.json, sidecar, safetensors); its
weights file is sparse: real headers and a real vocab mapping, holes for the 1.2B float weights, which preflight
never reads.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from eaglenest.config import load_config
from eaglenest.contracts.layers import default_aux_layer_ids
from eaglenest.contracts.target import TargetSpec
from eaglenest.drafters.eagle3.config import DrafterModelConfig
from eaglenest.drafters.eagle3.format import SIDECAR, WEIGHTS, expected_shapes, hf_config
from eaglenest.drafters.preflight import run_preflight

REPO = Path(__file__).resolve().parents[2]


def _kimi_target(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "text_config": {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
                        "num_hidden_layers": 61, "hidden_size": 7168, "intermediate_size": 18432,
                        "num_attention_heads": 64, "vocab_size": 163840, "max_position_embeddings": 262144},
    }))
    return folder


def _sparse_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], real: dict[str, torch.Tensor]) -> None:
    """A valid safetensors file: ``real`` tensors written, every other tensor a hole of the right size."""
    dtypes = {torch.int64: ("I64", 8), torch.bool: ("BOOL", 1)}
    header, offset, blobs = {}, 0, []
    for name, shape in shapes.items():
        if name in real:
            code, size = dtypes[real[name].dtype]
        else:
            code, size = "BF16", 2
        n = size
        for s in shape:
            n *= s
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + n]}
        if name in real:
            blobs.append((offset, real[name].numpy().tobytes()))
        offset += n
    header["__metadata__"] = {"format": "pt"}
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        base = f.tell()
        for off, data in blobs:
            f.seek(base + off)
            f.write(data)
        f.truncate(base + offset)


@pytest.fixture(scope="module")
def kimi_drafter(tmp_path_factory) -> tuple[Path, Path, object]:
    cfg = load_config(REPO / "configs" / "kimi-k25.yaml")
    d = cfg.train.drafter
    root = tmp_path_factory.mktemp("kimi-preflight")
    target = _kimi_target(root / "target")
    physical = cfg.target.aux_layer_ids or default_aux_layer_ids(61)
    mcfg = DrafterModelConfig(
        hidden_size=7168, num_attention_heads=d.num_heads or 64, num_key_value_heads=d.num_kv_heads or 64,
        head_dim=d.head_dim or 128, intermediate_size=d.intermediate_size or 18432, vocab_size=163840,
        draft_vocab_size=d.draft_vocab_size, aux_layer_ids=list(physical), target_hidden_size=7168,
        target_num_layers=61, max_position_embeddings=d.max_position_embeddings or 262144, target=str(target),
    )
    out = root / "drafter"
    out.mkdir()
    ids = torch.arange(0, 163840, 163840 // mcfg.draft_vocab_size)[: mcfg.draft_vocab_size]
    d2t = ids - torch.arange(mcfg.draft_vocab_size)
    t2d = torch.zeros(163840, dtype=torch.bool)
    t2d[ids] = True
    shapes = {k: v for k, v in expected_shapes(mcfg).items() if k != "embed_tokens.weight"}
    _sparse_safetensors(out / WEIGHTS, shapes, {"d2t": d2t.to(torch.int64), "t2d": t2d})
    (out / "config.json").write_text(json.dumps(hf_config(mcfg, "sglang", "bfloat16"), indent=2))
    (out / SIDECAR).write_text(json.dumps({
        "format": "sglang", "aux_layer_ids_physical": list(physical), "config_aux_layer_ids": [i - 1 for i in physical],
        "target": str(target), "target_num_layers": 61, "target_hidden_size": 7168, "target_vocab_size": 163840,
        "draft_vocab_size": mcfg.draft_vocab_size, "dtype": "bfloat16", "includes_embedding": False,
        "drafter_config": mcfg.to_dict(),
    }))
    context = cfg.target.sglang.context_length
    return target, out, TargetSpec.read(target, context_length=context)


def test_kimi_config_drafter_passes_sglang_preflight(kimi_drafter):
    _, drafter, target = kimi_drafter
    report = run_preflight(target, drafter, algorithm="EAGLE3", engine="sglang")
    failed = [c for c in report.checks if not c.ok]
    assert not failed, "\n".join(f"{c.name}: {c.message}" for c in failed)
    assert json.loads((drafter / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"] \
        == [1, 29, 57]


def test_kimi_config_drafter_under_eagle_is_refused(kimi_drafter):
    _, drafter, target = kimi_drafter
    report = run_preflight(target, drafter, algorithm="EAGLE", engine="sglang")
    bad = {c.name: c.message for c in report.checks if not c.ok}
    assert list(bad) == ["algorithm"] and "EAGLE-3 checkpoint" in bad["algorithm"], bad


def test_wrong_target_depth_is_refused(kimi_drafter, tmp_path):
    _, drafter, _ = kimi_drafter
    shallow = json.loads((kimi_drafter[0] / "config.json").read_text())
    shallow["text_config"]["num_hidden_layers"] = 30  # tap 58 does not exist in a 30-layer model
    (tmp_path / "config.json").write_text(json.dumps(shallow))
    report = run_preflight(TargetSpec.read(tmp_path), drafter, algorithm="EAGLE3", engine="sglang")
    bad = {c.name: c.message for c in report.checks if not c.ok}
    assert bad and any("58" in m or "layer" in m for m in bad.values()), bad
