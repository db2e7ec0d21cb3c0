"""One layer-id translation for every reader: each architecture record's SGLang/vLLM rule, and export, capture and
preflight agreeing on it — including the case a naive ``physical - 1`` export got wrong (DeepseekV3 taps that do not
start at physical 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eaglenest.contracts.layers import LayerIdError, engine_captured_layers, engine_layer_ids
from eaglenest.contracts.target import TargetSpec
from eaglenest.drafter.export import export_drafter
from eaglenest.drafters.eagle3.model import DrafterModelConfig, Eagle3Drafter
from eaglenest.drafters.preflight import run_preflight
from eaglenest.engines.sglang.hooks import hook_specs
from eaglenest.targets import DEEPSEEK_V3, GENERIC, KIMI_K25, LLAMA, QWEN, arch_for

N = 61
DS, LL = "DeepseekV3ForCausalLM", "LlamaForCausalLM"


@pytest.mark.parametrize("rec", [LLAMA, QWEN, GENERIC])
def test_llama_style_records_add_one(rec) -> None:
    assert rec.sglang_captured([1, 29, 57], N) == [2, 30, 58]
    assert rec.sglang_ids([2, 30, 58], N) == [1, 29, 57]
    assert rec.sglang_ids([3, 30, 58], N) == [2, 29, 57]
    assert rec.sglang_captured(None, N) == [2, 30, 58]


@pytest.mark.parametrize("rec", [DEEPSEEK_V3, KIMI_K25])
def test_deepseek_records_use_the_first_id_rule(rec) -> None:
    # measured on the H200 with SGLang 0.5.14: [1,2,3] and [2,3,4] both capture physical [2,3,4]
    assert rec.sglang_captured([1, 2, 3], N) == rec.sglang_captured([2, 3, 4], N) == [2, 3, 4]
    assert rec.sglang_ids([2, 30, 58], N) == [1, 29, 57]  # works under both rules (and 0.5.10's always-add)
    assert rec.sglang_ids([3, 30, 58], N) == [3, 30, 58]
    assert rec.sglang_ids([1, 4, 6], N) is None  # no list makes SGLang tap physical 1 of these targets
    assert rec.attention == "mla"


def test_vllm_reads_physical_ids_for_every_architecture() -> None:
    for arch in (LL, DS, "KimiK25ForConditionalGeneration", "SomethingElse"):
        assert engine_layer_ids([3, 30, 58], engine="vllm", architecture=arch, num_layers=N) == [3, 30, 58]
    with pytest.raises(LayerIdError, match="unknown engine"):
        engine_layer_ids([2, 30, 58], engine="trt", architecture=LL, num_layers=N)
    with pytest.raises(LayerIdError, match="no eagle_aux_hidden_state_layer_ids"):
        engine_layer_ids([1, 4, 6], engine="sglang", architecture=DS, num_layers=N)


def test_records_are_found_by_architecture_and_model_type() -> None:
    assert arch_for(DS) is DEEPSEEK_V3 and arch_for("KimiK25ForConditionalGeneration") is KIMI_K25
    assert arch_for(None, "deepseek_v3") is DEEPSEEK_V3 and arch_for("Unknown") is GENERIC
    assert arch_for("Qwen3ForCausalLM") is QWEN and arch_for(LL) is LLAMA


def _export(tmp_path: Path, architecture: str, physical: list[int], fmt: str = "sglang") -> Path:
    cfg = DrafterModelConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             intermediate_size=128, vocab_size=512, draft_vocab_size=128, aux_layer_ids=physical,
                             target_hidden_size=64, target_num_layers=N, max_position_embeddings=2048,
                             target_architecture=architecture)
    torch.manual_seed(0)
    return export_drafter(Eagle3Drafter(cfg), tmp_path / f"{architecture}-{fmt}", fmt=fmt)


def _target(architecture: str) -> TargetSpec:
    return TargetSpec(num_layers=N, hidden_size=64, vocab_size=512, architecture=architecture, context_length=2048,
                      max_position_embeddings=2048, num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def _written(folder: Path) -> list[int]:
    return json.loads((folder / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]


def test_deepseek_non_default_taps_export_capture_and_preflight_agree(tmp_path: Path) -> None:
    phys = [3, 30, 58]
    d = _export(tmp_path, DS, phys)
    # export names the ids SGLang needs; the old physical - 1 export wrote [2, 29, 57], which SGLang's DeepseekV2
    # rule takes as physical [2, 29, 57]: three wrong layers, no error anywhere
    assert _written(d) == [3, 30, 58]
    assert engine_captured_layers(_written(d), engine="sglang", architecture=DS, num_layers=N) == phys
    assert engine_captured_layers([2, 29, 57], engine="sglang", architecture=DS, num_layers=N) == [2, 29, 57]
    # capture during generation hooks the layers whose outputs are those streams
    assert [s["target_modules"] for s in hook_specs("/tmp/x", phys, architecture=DS)][:3] == [
        ["model.layers.2"], ["model.layers.29"], ["model.layers.57"]]
    # preflight checks what SGLang will really capture against what the drafter trained on
    report = run_preflight(_target(DS), d, engine="sglang")
    checks = {c.name: c for c in report.checks}
    assert checks["aux_layer_ids"].ok, checks["aux_layer_ids"].message
    # the same export on a Llama-numbered target would capture [4, 31, 59]: refused, with the ids to write
    wrong = run_preflight(_target(LL), d, engine="sglang")
    bad = {c.name: c for c in wrong.checks}["aux_layer_ids"]
    assert not bad.ok and "[4, 31, 59]" in bad.message and "[2, 29, 57]" in bad.fix


@pytest.mark.parametrize(("architecture", "phys", "written"), [
    (LL, [2, 30, 58], [1, 29, 57]), (LL, [3, 30, 58], [2, 29, 57]),
    (DS, [2, 30, 58], [1, 29, 57]), ("KimiK25ForConditionalGeneration", [3, 30, 58], [3, 30, 58]),
])
def test_export_and_preflight_agree_with_default_and_non_default_taps(tmp_path: Path, architecture: str,
                                                                      phys: list[int], written: list[int]) -> None:
    d = _export(tmp_path, architecture, phys)
    assert _written(d) == written
    sidecar = json.loads((d / "eaglenest_drafter.json").read_text())
    assert sidecar["aux_layer_ids_physical"] == phys and sidecar["target_architecture"] == architecture
    assert {c.name: c.ok for c in run_preflight(_target(architecture), d, engine="sglang").checks}["aux_layer_ids"]
    v = _export(tmp_path, architecture, phys, fmt="vllm")
    assert _written(v) == phys
