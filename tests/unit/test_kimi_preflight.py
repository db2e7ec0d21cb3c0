"""Preflight of configs/kimi-k25.yaml's drafter against Kimi-K2.5's real config.json (tests/fixtures/kimi_k25), at full
size, without GBs on disk: accepted in both draft shapes (Llama-shaped LlamaForCausalLMEagle3, MLA-shaped
Eagle3DeepseekV2ForCausalLM), refused for the seed's mistakes with the seed's numbers (EAGLE instead of EAGLE3: the
drafter would get 7168-wide states, not 21504), wrong aux ids, a wrong count of them, another target's hidden size or
vocab.

Each drafter folder is what `eaglenest train` would export for that config: the drafter config comes from the
training path (``resolve_model_config`` over ``TargetSpec``), config.json and the sidecar from the export's own
writers. Its weights file is sparse: real headers and a real vocab mapping, holes for the float weights (1.2B of
them), which preflight never reads.
"""

from __future__ import annotations

import json
import struct
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from eaglenest.cli import main as cli_main
from eaglenest.config import EaglenestConfig, load_config
from eaglenest.contracts.target import TargetSpec
from eaglenest.drafter.shape import resolve_model_config
from eaglenest.drafters.eagle3.config import DrafterModelConfig
from eaglenest.drafters.eagle3.format import SIDECAR, WEIGHTS, expected_shapes, hf_config, sidecar_record
from eaglenest.drafters.preflight import preflight_for_config, run_preflight

REPO = Path(__file__).resolve().parents[2]
KIMI_TARGET = REPO / "tests" / "fixtures" / "kimi_k25"
H, V, N = 7168, 163840, 61
SHAPES = {"llama": "LlamaForCausalLMEagle3", "mla": "Eagle3DeepseekV2ForCausalLM"}


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


def _export(out: Path, mcfg: DrafterModelConfig, *, config_ids: list[int] | None = None,
            physical: list[int] | None = None, shapes: dict[str, tuple[int, ...]] | None = None) -> Path:
    """The export folder of ``mcfg`` (weights as holes). ``config_ids`` / ``physical`` / ``shapes`` replace what
    config.json, the sidecar or the weights file would carry: the hand-made mistakes."""
    out.mkdir(parents=True)
    dv, v = mcfg.draft_vocab_size, mcfg.vocab_size
    ids = torch.arange(0, v, v // dv)[:dv]
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[ids] = True
    all_shapes = {k: s for k, s in expected_shapes(mcfg).items() if k != "embed_tokens.weight"} | (shapes or {})
    _sparse_safetensors(out / WEIGHTS, all_shapes, {"d2t": (ids - torch.arange(dv)).to(torch.int64), "t2d": t2d})
    config = hf_config(mcfg, "sglang", "bfloat16")
    sidecar = sidecar_record(mcfg, "sglang", "bfloat16", includes_embedding=False)
    if config_ids is not None:
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = sidecar["config_aux_layer_ids"] = config_ids
    if physical is not None:
        sidecar["aux_layer_ids_physical"] = physical
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / SIDECAR).write_text(json.dumps(sidecar, indent=2))
    return out


def _with_shape(cfg: EaglenestConfig, draft_shape: str) -> EaglenestConfig:
    drafter = cfg.train.drafter.model_copy(update={"draft_shape": draft_shape})
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"drafter": drafter})})


@pytest.fixture(scope="module")
def cfg() -> EaglenestConfig:
    return load_config(REPO / "configs" / "kimi-k25.yaml")


@pytest.fixture(scope="module")
def kimi(cfg) -> TargetSpec:
    """The target as serving sees it: the real config.json, at the engine's context (32768)."""
    return TargetSpec.read(KIMI_TARGET, context_length=cfg.target.sglang.context_length)


def _drafter_config(cfg: EaglenestConfig, target: TargetSpec, draft_shape: str) -> DrafterModelConfig:
    """What `eaglenest train --config configs/kimi-k25.yaml` builds for ``target`` (train.drafter, its taps)."""
    return resolve_model_config(_with_shape(cfg, draft_shape), target, cfg.target.aux_layer_ids,
                                cfg.train.drafter.draft_vocab_size)


@pytest.fixture(scope="module", params=list(SHAPES))
def kimi_drafter(request, cfg, kimi, tmp_path_factory) -> Path:
    mcfg = _drafter_config(cfg, kimi, request.param)
    return _export(tmp_path_factory.mktemp(f"kimi-{request.param}") / "drafter", mcfg)


@pytest.fixture(scope="module")
def llama_drafter_config(cfg, kimi) -> DrafterModelConfig:
    return _drafter_config(cfg, kimi, "llama")


def _failed(report) -> dict[str, object]:
    return {c.name: c for c in report.failures}


def test_the_yaml_drafter_is_built_for_kimi(kimi_drafter, cfg):
    conf = json.loads((kimi_drafter / "config.json").read_text())
    shape = "mla" if conf["architectures"] == [SHAPES["mla"]] else "llama"
    assert conf["architectures"] == [SHAPES[shape]]
    assert (conf["hidden_size"], conf["vocab_size"], conf["draft_vocab_size"]) == (H, V, 32000)
    assert conf["draft_vocab_size"] == cfg.train.drafter.draft_vocab_size
    assert conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 29, 57]  # SGLang captures [2, 30, 58]
    assert conf["max_position_embeddings"] == 262144  # from the target: SGLang refuses a shorter drafter
    side = json.loads((kimi_drafter / SIDECAR).read_text())
    assert (side["aux_layer_ids_physical"], side["target_hidden_size"], side["target_num_layers"]) \
        == ([2, 30, 58], H, N)
    if shape == "mla":  # the target's MLA widths, read from its text_config
        assert [conf[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                  "v_head_dim")] == [1536, 512, 128, 64, 128]


def test_kimi_config_drafter_passes_sglang_preflight(kimi_drafter, kimi, cfg):
    report = run_preflight(kimi, kimi_drafter, algorithm="EAGLE3", engine="sglang")
    assert report.ok, report.format()
    msg = {c.name: c.message for c in report.checks}
    assert "fc.weight [7168, 21504] takes 3 x 7168" in msg["fc_input"]
    assert "captures physical layers [2, 30, 58] from config ids [1, 29, 57]" in msg["aux_layer_ids"]
    assert "61 layers, hidden 7168, vocab 163840, context 32768" in msg["target_config"]
    assert msg["vocab"] == "target vocab 163840, draft vocab 32000"
    assert "on a target with mla attention" in msg["draft_shape"]
    # the serve path: target and engine from `target:`, algorithm from serve.spec (EAGLE3), context 32768
    served = preflight_for_config(cfg, kimi_drafter, folder=KIMI_TARGET)
    assert served.ok and served.algorithm == "EAGLE3", served.format()


def test_kimi_config_drafter_under_eagle_is_refused_with_the_seeds_numbers(kimi_drafter, kimi):
    report = run_preflight(kimi, kimi_drafter, algorithm="EAGLE", engine="sglang")
    bad = _failed(report)
    assert list(bad) == ["algorithm"], report.format()
    check = bad["algorithm"]
    assert "EAGLE-3 checkpoint" in check.message and "the algorithm is EAGLE:" in check.message
    assert ("the engine would feed it the final hidden state instead of the 3 aux layers, skip its fc, replace its "
            "lm_head with the target's") in check.message
    assert ("in numbers: under EAGLE the drafter would get 7168-wide states instead of the 3 x 7168 = 21504-wide aux "
            "states of layers [2, 30, 58] its fc.weight [7168, 21504] takes") in check.message
    assert "accept length would sit at 1.0" in check.message
    assert "--algorithm EAGLE3" in check.fix and "serve.spec.algorithm: EAGLE3" in check.fix


def test_serve_config_with_eagle_is_refused(kimi_drafter, cfg):
    spec = cfg.serve.spec.model_copy(update={"algorithm": "EAGLE"})
    eagle = cfg.model_copy(update={"serve": cfg.serve.model_copy(update={"spec": spec})})
    report = preflight_for_config(eagle, kimi_drafter, folder=KIMI_TARGET)
    assert [c.name for c in report.failures] == ["algorithm"]
    assert "7168-wide states" in report.failure_message() and "21504-wide" in report.failure_message()


def test_eaglenest_preflight_cli_refuses_eagle(kimi_drafter, capsys):
    args = ["preflight", "--target", str(KIMI_TARGET), "--drafter", str(kimi_drafter), "--engine", "sglang",
            "--context-length", "32768"]
    assert cli_main([*args, "--algorithm", "EAGLE3"]) == 0
    capsys.readouterr()
    assert cli_main([*args, "--algorithm", "EAGLE"]) == 1
    err = capsys.readouterr().err
    assert "[algorithm]" in err and "7168-wide states" in err and "3 x 7168 = 21504-wide" in err
    assert "fix: use --algorithm EAGLE3" in err


@pytest.mark.parametrize(("config_ids", "physical", "message", "fix"), [
    # the first id "fixed" by hand: SGLang's DeepseekV2 rule then adds 1 to every id
    ([1, 30, 58], None, "would capture physical layers [2, 31, 59] from eagle_aux_hidden_state_layer_ids "
                        "[1, 30, 58], but the drafter was trained on [2, 30, 58]",
     "eagle_aux_hidden_state_layer_ids: [1, 29, 57]"),
    # non-default taps written with Llama's "physical - 1" rule (the ARCHITECTURE.md story): 3 wrong layers
    ([2, 29, 57], [3, 30, 58], "would capture physical layers [2, 29, 57] from eagle_aux_hidden_state_layer_ids "
                               "[2, 29, 57], but the drafter was trained on [3, 30, 58]",
     "eagle_aux_hidden_state_layer_ids: [3, 30, 58]"),
    # a tap past the last decoder layer
    ([2, 30, 61], None, "would capture layers [2, 30, 61] from eagle_aux_hidden_state_layer_ids [2, 30, 61]: aux "
                        "layer ids [61] are out of range for a 61-layer target: physical ids must lie in 1..60",
     "eagle_aux_hidden_state_layer_ids: [1, 29, 57]"),
])
def test_wrong_aux_ids_are_refused_with_the_ids(llama_drafter_config, kimi, tmp_path, config_ids, physical,
                                               message, fix):
    drafter = _export(tmp_path / "d", llama_drafter_config, config_ids=config_ids, physical=physical)
    check = _failed(run_preflight(kimi, drafter, algorithm="EAGLE3", engine="sglang"))["aux_layer_ids"]
    assert "KimiK25ForConditionalGeneration: adds 1 only when the first id is 1" in check.message
    assert message in check.message, check.message
    assert fix in check.fix, check.fix


def test_two_aux_layers_instead_of_three_are_refused(llama_drafter_config, kimi, tmp_path):
    """A drafter fusing 2 layers (fc takes 2 x 7168 = 14336): both the ids and fc say so, and no id list is offered as
    the fix."""
    drafter = _export(tmp_path / "d", llama_drafter_config, config_ids=[1, 29], physical=[2, 30],
                      shapes={"fc.weight": (H, 2 * H)})
    bad = _failed(run_preflight(kimi, drafter, algorithm="EAGLE3", engine="sglang"))
    assert set(bad) == {"aux_layer_ids", "fc_input"}, bad
    assert "EAGLE-3 fuses exactly 3 aux layers, got 2: [2, 30]" in bad["aux_layer_ids"].message
    assert "train a drafter on 3 layers of this target (default [2, 30, 58])" in bad["aux_layer_ids"].fix
    assert "eagle_aux_hidden_state_layer_ids:" not in bad["aux_layer_ids"].fix
    assert ("fc.weight is [7168, 14336] (fc.weight takes 14336 inputs); EAGLE-3 fuses 3 aux layers: "
            "[hidden, 3 x 7168] = [7168, 21504]") in bad["fc_input"].message


def test_a_drafter_for_another_hidden_size_is_refused(cfg, kimi, tmp_path):
    """A drafter trained on a 5120-wide target: every width it was built for is named next to Kimi's."""
    other = replace(kimi, hidden_size=5120, head_dim=80, path="another-target")
    drafter = _export(tmp_path / "d", _drafter_config(cfg, other, "llama"))
    bad = _failed(run_preflight(kimi, drafter, algorithm="EAGLE3", engine="sglang"))
    assert {"hidden_size", "fc_input", "trained_target"} <= set(bad), bad
    assert bad["hidden_size"].message == ("the drafter was built for target hidden size 5120, the target has 7168; "
                                          "drafter hidden_size 5120 != target hidden 7168 (the drafter shares the "
                                          "target's embedding)")
    assert "train one on this target's hidden states" in bad["hidden_size"].fix
    assert "fc.weight is [5120, 15360]" in bad["fc_input"].message and "3 x 7168" in bad["fc_input"].message
    assert "hidden size 5120 (trained) != 7168 (this target)" in bad["trained_target"].message


def test_a_drafter_for_another_vocab_is_refused(cfg, kimi, tmp_path):
    """Same depth and width, another tokenizer: a drafter trained on DeepSeek-V3 (vocab 129280) served on Kimi."""
    deepseek = replace(kimi, vocab_size=129280, architecture="DeepseekV3ForCausalLM", path="deepseek-ai/DeepSeek-V3")
    drafter = _export(tmp_path / "d", _drafter_config(cfg, deepseek, "llama"))
    bad = _failed(run_preflight(kimi, drafter, algorithm="EAGLE3", engine="sglang"))
    assert {"vocab", "vocab_mapping", "trained_target"} <= set(bad), bad
    assert "drafter vocab_size 129280 != target vocab 163840" in bad["vocab"].message
    assert "vocab_size = target vocab" in bad["vocab"].fix
    assert "t2d has shape [129280], expected [163840] (target vocab)" in bad["vocab_mapping"].message
    assert "vocab 129280 (trained) != 163840 (this target)" in bad["trained_target"].message


def test_wrong_target_depth_is_refused(kimi_drafter, tmp_path):
    shallow = json.loads((KIMI_TARGET / "config.json").read_text())
    shallow["text_config"]["num_hidden_layers"] = 30  # taps 30 and 58 do not exist in a 30-layer model
    (tmp_path / "config.json").write_text(json.dumps(shallow))
    bad = _failed(run_preflight(TargetSpec.read(tmp_path), kimi_drafter, algorithm="EAGLE3", engine="sglang"))
    assert "aux layer ids [30, 58] are out of range for a 30-layer target" in bad["aux_layer_ids"].message
    assert "default [2, 15, 27]" in bad["aux_layer_ids"].fix
    assert "layers 61 (trained) != 30 (this target)" in bad["trained_target"].message


def test_the_shipped_config_trains_the_measured_winner_and_mla_on_request(cfg, kimi):
    """The Kimi config's default draft shape is the one measured faster at Kimi's widths (BENCHMARKS.md): the
    Llama-shaped head, 64 heads of 7168 / 64 = 112; ``draft_shape: mla`` gives the MLA drafter with the target's q/kv
    ranks and head dims, in the class SGLang's Kimi drafter loader reads."""
    mcfg = resolve_model_config(cfg, kimi, cfg.target.aux_layer_ids, cfg.train.drafter.draft_vocab_size)
    conf = hf_config(mcfg, "sglang", "bfloat16")
    assert conf["architectures"] == [SHAPES["llama"]]
    assert (conf["hidden_size"], conf["num_attention_heads"]) == (H, 64)
    mla = _with_shape(cfg, "mla")
    conf = hf_config(resolve_model_config(mla, kimi, cfg.target.aux_layer_ids, cfg.train.drafter.draft_vocab_size),
                     "sglang", "bfloat16")
    assert conf["architectures"] == [SHAPES["mla"]]
    assert [conf[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                              "v_head_dim")] == [1536, 512, 128, 64, 128]
    assert (conf["hidden_size"], conf["num_attention_heads"]) == (H, 64)
