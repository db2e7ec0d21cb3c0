"""Preflight of MLA drafters (drafters/shape_checks.py): refused on a non-MLA target with the fix named, accepted on a
DeepSeek-V3 / Kimi-K2.5 target; per-shape tensor checks (a missing MLA tensor, a ``model.`` prefix SGLang's MLA loader
would drop, a shape that does not fit config.json). A Llama-shaped drafter stays accepted on an MLA target (SGLang
serves LlamaForCausalLMEagle3 drafters for Kimi-K2.5; tests/unit/test_kimi_preflight.py covers the full-size one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from mla_helpers import HEADS, H, V, mla_drafter
from safetensors.torch import load_file, save_file

from eaglenest.drafters.eagle3.format import WEIGHTS
from eaglenest.drafters.preflight import run_preflight


def _target(folder: Path, architecture: str, model_type: str, **extra) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": [architecture], "model_type": model_type, "num_hidden_layers": 8, "hidden_size": H,
           "intermediate_size": 2 * H, "num_attention_heads": HEADS, "num_key_value_heads": HEADS,
           "vocab_size": V, "max_position_embeddings": 512, **extra}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.fixture(scope="module")
def mla_export(tmp_path_factory) -> Path:
    m, _, _ = mla_drafter(11)
    return m.save_pretrained(tmp_path_factory.mktemp("mla") / "drafter", dtype="float32")


def _checks(report) -> dict:
    return {c.name: c for c in report.checks}


@pytest.mark.parametrize(("architecture", "model_type"), [
    ("DeepseekV3ForCausalLM", "deepseek_v3"), ("KimiK25ForConditionalGeneration", "kimi_k25")])
def test_mla_drafter_passes_on_an_mla_target(mla_export: Path, tmp_path: Path, architecture, model_type) -> None:
    target = _target(tmp_path / "t", architecture, model_type, q_lora_rank=20, kv_lora_rank=12)
    report = run_preflight(target, mla_export, engine="sglang")
    assert report.ok, report.format()
    assert _checks(report)["draft_shape"].ok and report.algorithm == "EAGLE3"


def test_mla_drafter_refused_on_a_gqa_target(mla_export: Path, tmp_path: Path) -> None:
    target = _target(tmp_path / "llama", "LlamaForCausalLM", "llama")
    report = run_preflight(target, mla_export, engine="hf")
    check = _checks(report)["draft_shape"]
    assert not check.ok and "MLA drafter" in check.message and "gqa attention" in check.message
    assert "draft_shape: llama" in check.fix
    assert [c.name for c in report.failures] == ["draft_shape"]


def _rewrite(src: Path, dst: Path, *, drop: str | None = None, prefix: bool = False,
             reshape: str | None = None) -> Path:
    import shutil

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / WEIGHTS))
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = torch.zeros(tensors[reshape].shape[0] + 1, *tensors[reshape].shape[1:])
    if prefix:
        tensors = {(k if k.startswith("lm_head") else f"model.{k}"): v for k, v in tensors.items()}
    save_file(tensors, str(dst / WEIGHTS))
    return dst


@pytest.mark.parametrize(("change", "needle"), [
    ({"drop": "midlayer.self_attn.kv_a_proj_with_mqa.weight"}, "weights missing"),
    ({"prefix": True}, "'model.' prefix"),
    ({"reshape": "midlayer.self_attn.kv_b_proj.weight"}, "config.json needs"),
])
def test_mla_tensor_problems_are_refused(mla_export: Path, tmp_path: Path, change: dict, needle: str) -> None:
    drafter = _rewrite(mla_export, tmp_path / "bad", **change)
    target = _target(tmp_path / "t", "DeepseekV3ForCausalLM", "deepseek_v3")
    check = _checks(run_preflight(target, drafter, engine="sglang"))["required_tensors"]
    assert not check.ok and needle in check.message, check.message


def test_mla_config_without_q_lora_rank_is_refused(mla_export: Path, tmp_path: Path) -> None:
    import shutil

    drafter = tmp_path / "noq"
    shutil.copytree(mla_export, drafter)
    cfg = json.loads((drafter / "config.json").read_text())
    cfg["q_lora_rank"] = None
    cfg["model_type"] = "llama"
    (drafter / "config.json").write_text(json.dumps(cfg))
    target = _target(tmp_path / "t", "DeepseekV3ForCausalLM", "deepseek_v3")
    check = _checks(run_preflight(target, drafter, engine="sglang"))["drafter_structure"]
    assert not check.ok and "q_lora_rank" in check.message and "model_type 'llama'" in check.message
