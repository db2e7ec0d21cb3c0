"""Preflight refuses the silent mismatches (EAGLE vs EAGLE3, layer ids, sizes, tensors, vocab maps, context)."""

from __future__ import annotations

import json
import shutil

import pytest
from serve_helpers import make_drafter, rewrite_tensors

from eaglenest.drafters.preflight import PreflightError, preflight_or_raise, run_preflight


@pytest.fixture(scope="module")
def good_drafter(tmp_path_factory, tiny_target_path):
    return make_drafter(tmp_path_factory.mktemp("pf") / "good", tiny_target_path)


def _copy(src, tmp_path, name="d"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def _failed(report) -> dict[str, str]:
    return {c.name: f"{c.message} || fix: {c.fix}" for c in report.failures}


@pytest.mark.parametrize("engine", ["hf", "sglang"])
def test_good_drafter_passes_and_algorithm_is_derived(good_drafter, tiny_target_path, engine):
    report = run_preflight(tiny_target_path, good_drafter, engine=engine)
    assert report.ok, report.format()
    assert report.algorithm == "EAGLE3"
    names = {c.name for c in report.checks}
    assert {"algorithm", "aux_layer_ids", "hidden_size", "fc_input", "vocab", "vocab_mapping", "context_length",
            "required_tensors"} <= names
    assert report.to_dict()["ok"] is True


def test_eagle3_drafter_under_eagle_is_refused(good_drafter, tiny_target_path):
    report = run_preflight(tiny_target_path, good_drafter, algorithm="EAGLE")
    failed = _failed(report)
    assert list(failed) == ["algorithm"]
    assert "EAGLE-3 checkpoint" in failed["algorithm"] and "EAGLE3" in failed["algorithm"].split("fix:")[1]
    with pytest.raises(PreflightError, match="algorithm EAGLE3"):
        preflight_or_raise(tiny_target_path, good_drafter, algorithm="EAGLE")


def test_ids_beyond_the_target_layers(tmp_path, tiny_target_path):
    d = make_drafter(tmp_path / "far", tiny_target_path, aux_layer_ids=(2, 4, 12))  # the tiny target has 8 layers
    for engine in ("hf", "sglang"):
        failed = _failed(run_preflight(tiny_target_path, d, engine=engine))
        assert "aux_layer_ids" in failed, engine
        assert "12" in failed["aux_layer_ids"] and "8-layer target" in failed["aux_layer_ids"]
        assert "fix:" in failed["aux_layer_ids"] and failed["aux_layer_ids"].split("fix:")[1].strip()


def test_wrong_hidden_size(tmp_path, tiny_target_path):
    d = make_drafter(tmp_path / "narrow", tiny_target_path, hidden=64)  # the tiny target's hidden is 128
    failed = _failed(run_preflight(tiny_target_path, d))
    assert "hidden_size" in failed and "128" in failed["hidden_size"]
    assert "fc_input" in failed and "3 x 128" in failed["fc_input"]
    assert "train" in failed["hidden_size"].split("fix:")[1]


def test_missing_tensor(tmp_path, good_drafter, tiny_target_path):
    d = _copy(good_drafter, tmp_path)
    rewrite_tensors(d, lambda t: {k: v for k, v in t.items() if k != "midlayer.mlp.down_proj.weight"})
    failed = _failed(run_preflight(tiny_target_path, d))
    assert list(failed) == ["required_tensors"]
    assert "midlayer.mlp.down_proj.weight" in failed["required_tensors"]
    assert "re-export" in failed["required_tensors"]


def test_inconsistent_vocab_maps(tmp_path, good_drafter, tiny_target_path):
    import torch

    d = _copy(good_drafter, tmp_path)

    def break_t2d(t):
        t2d = t["t2d"].clone()
        t2d[int(torch.nonzero(t2d)[0])] = False
        t2d[int(torch.nonzero(~t2d)[0])] = True  # same count, but t2d no longer marks what d2t reaches
        return {**t, "t2d": t2d}

    rewrite_tensors(d, break_t2d)
    failed = _failed(run_preflight(tiny_target_path, d))
    assert list(failed) == ["vocab_mapping"] and "disagree" in failed["vocab_mapping"]

    def oob_d2t(t):
        d2t = t["d2t"].clone()
        d2t[-1] = 10_000
        return {**t, "d2t": d2t}

    rewrite_tensors(d, oob_d2t)
    assert "outside the target vocab" in _failed(run_preflight(tiny_target_path, d))["vocab_mapping"]


def test_context_length(tmp_path, tiny_target_path):
    d = make_drafter(tmp_path / "short", tiny_target_path, max_position_embeddings=512)
    failed = _failed(run_preflight(tiny_target_path, d, engine="sglang"))
    assert list(failed) == ["context_length"] and "512 < target context 2048" in failed["context_length"]
    assert run_preflight(tiny_target_path, d, engine="sglang", context_length=512).ok


def _kimi_like_target(tmp_path, hidden: int, vocab: int):
    """A config.json-only target in Kimi-K2.5's shape (multimodal wrapper, 61 layers under text_config)."""
    folder = tmp_path / "kimi"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "text_config": {"num_hidden_layers": 61, "hidden_size": hidden, "vocab_size": vocab,
                        "max_position_embeddings": 2048, "architectures": ["DeepseekV3ForCausalLM"]},
    }))
    return folder


def test_sglang_first_id_rule_for_kimi_targets(tmp_path, tiny_target_path):
    """SGLang 0.5.14 adds 1 to DeepSeek/Kimi ids only when the first id is 1: the check follows the engine's rule."""
    kimi = _kimi_like_target(tmp_path, hidden=128, vocab=980)
    good = make_drafter(tmp_path / "default_taps", tiny_target_path, aux_layer_ids=(2, 30, 58))
    for d in (good,):
        side = json.loads((d / "eaglenest_drafter.json").read_text())
        side["target_num_layers"] = 61
        (d / "eaglenest_drafter.json").write_text(json.dumps(side))
    assert run_preflight(kimi, good, engine="sglang").ok  # config ids [1, 29, 57] -> captured [2, 30, 58]

    odd = make_drafter(tmp_path / "odd_taps", tiny_target_path, aux_layer_ids=(3, 30, 58))
    side = json.loads((odd / "eaglenest_drafter.json").read_text())
    side["target_num_layers"] = 61
    (odd / "eaglenest_drafter.json").write_text(json.dumps(side))
    failed = _failed(run_preflight(kimi, odd, engine="sglang"))
    # config ids [2, 29, 57]: first id is not 1, so Kimi captures [2, 29, 57], not the trained [3, 30, 58]
    assert list(failed) == ["aux_layer_ids"]
    assert "[2, 29, 57]" in failed["aux_layer_ids"] and "[3, 30, 58]" in failed["aux_layer_ids"]
    assert "eagle_aux_hidden_state_layer_ids: [3, 30, 58]" in failed["aux_layer_ids"]
    assert run_preflight(kimi, odd, engine="hf").ok  # the hf reference decoder taps the physical ids directly


def test_drafter_for_another_target(tmp_path, good_drafter):
    other = _kimi_like_target(tmp_path, hidden=128, vocab=980)
    failed = _failed(run_preflight(other, good_drafter))
    assert "trained_target" in failed and "8 (trained) != 61" in failed["trained_target"]


def test_unreadable_inputs_are_failed_checks(tmp_path, good_drafter):
    report = run_preflight(tmp_path / "nope", good_drafter)
    assert not report.ok and "target_config" in _failed(report)
    report = run_preflight(tmp_path, tmp_path / "missing")
    assert not report.ok and "drafter_config" in _failed(report)


def test_cli_exit_codes(good_drafter, tiny_target_path, capsys):
    from eaglenest.cli import main

    assert main(["preflight", "--target", str(tiny_target_path), "--drafter", str(good_drafter)]) == 0
    assert "preflight passed" in capsys.readouterr().out
    rc = main(["preflight", "--target", str(tiny_target_path), "--drafter", str(good_drafter),
               "--algorithm", "EAGLE", "--engine", "sglang"])
    captured = capsys.readouterr()
    assert rc == 1
    assert "FAIL  algorithm" in captured.out and "fix: use --algorithm EAGLE3" in captured.err
    assert main(["preflight", "--target", str(tiny_target_path), "--drafter", str(good_drafter), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["algorithm"] == "EAGLE3"


def test_same_shape_but_another_target(tmp_path, good_drafter, tiny_target_path):
    """A drafter of another target with identical shapes (Kimi-K2 vs K2.5): its copy of the embedding gives it away."""
    d = _copy(good_drafter, tmp_path)
    assert {c.name: c.ok for c in run_preflight(tiny_target_path, d).checks}["target_embedding"]
    rewrite_tensors(d, lambda t: {**t, "embed_tokens.weight": t["embed_tokens.weight"].roll(1, dims=0)})
    failed = _failed(run_preflight(tiny_target_path, d))
    assert list(failed) == ["target_embedding"] and "another target of the same shape" in failed["target_embedding"]
    rewrite_tensors(d, lambda t: {k: v for k, v in t.items() if k != "embed_tokens.weight"})
    report = run_preflight(tiny_target_path, d)
    assert report.ok and "not checked" in {c.name: c.message for c in report.checks}["target_embedding"]
