"""configs/kimi-k25.yaml against Kimi-K2.5's real config.json (tests/fixtures/kimi_k25, see its README): TargetSpec
reads the multimodal wrapper as it is (and in the hub's own form), and the yaml's taps, engine shape and lengths agree
with that target under SGLang's layer-id rules."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from eaglenest.config import EaglenestConfig, SpecConfig, load_config
from eaglenest.contracts import layers
from eaglenest.contracts.target import TargetSpec
from eaglenest.drafter.shape import target_widths
from eaglenest.targets import KIMI_K25

REPO = Path(__file__).resolve().parents[2]
KIMI = REPO / "configs" / "kimi-k25.yaml"
KIMI_TARGET = REPO / "tests" / "fixtures" / "kimi_k25"


@pytest.fixture(scope="module")
def cfg() -> EaglenestConfig:
    return load_config(KIMI)


@pytest.fixture(scope="module")
def kimi_config_json() -> dict:
    return json.loads((KIMI_TARGET / "config.json").read_text())


@pytest.fixture(scope="module")
def kimi(cfg) -> TargetSpec:
    return TargetSpec.read(KIMI_TARGET, context_length=cfg.target.sglang.context_length)


def hub_form(conf: dict) -> dict:
    """The fixture as the hub file writes it (fixture README): Kimi's own text model_type, yarn as rope_scaling."""
    out = json.loads(json.dumps(conf))
    tc = out["text_config"]
    tc["model_type"] = "kimi_k2"
    rope = tc.pop("rope_parameters")
    tc["rope_scaling"] = {k: v for k, v in rope.items() if k not in ("rope_theta", "rope_type")}
    return out


def _expect_kimi(spec: TargetSpec) -> None:
    assert spec.architecture == "KimiK25ForConditionalGeneration" and spec.arch is KIMI_K25
    assert (spec.num_layers, spec.hidden_size, spec.vocab_size) == (61, 7168, 163840)
    assert (spec.num_attention_heads, spec.num_key_value_heads, spec.intermediate_size) == (64, 64, 18432)
    assert (spec.max_position_embeddings, spec.rope_theta, spec.rms_norm_eps) == (262144, 50000.0, 1e-5)
    assert (spec.dtype, spec.tie_word_embeddings) == ("bfloat16", False)  # `dtype`, not `torch_dtype`; INT4 experts
    assert (spec.bos_token_id, spec.eos_token_id) == (163584, 163585)
    assert spec.first_id_rule  # SGLang's DeepseekV2 numbering


def test_target_spec_reads_the_real_config_as_it_is(kimi, kimi_config_json):
    assert "vocab_size" not in kimi_config_json and "num_hidden_layers" not in kimi_config_json  # only text_config
    _expect_kimi(kimi)
    assert kimi.context_length == 32768  # the engine's, below the model's 262144
    assert layers.default_aux_layer_ids(kimi.num_layers) == kimi.arch.sglang_captured(None, kimi.num_layers) \
        == [2, 30, 58]
    assert target_widths(kimi) == {  # MLA ranks and MoE widths, read through the architecture record
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "n_routed_experts": 384, "num_experts_per_tok": 8, "n_shared_experts": 1, "moe_intermediate_size": 2048,
        "first_k_dense_replace": 1, "moe_layer_freq": 1}


def test_target_spec_reads_the_hub_form(kimi_config_json, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hub_form(kimi_config_json)))
    spec = TargetSpec.read(tmp_path)
    _expect_kimi(spec)
    assert spec.context_length == 262144
    assert replace(spec, path="") == replace(TargetSpec.read(KIMI_TARGET), path="")  # the same facts either way
    assert target_widths(spec) == target_widths(TargetSpec.read(KIMI_TARGET))


def test_loads_with_the_real_target_shape(cfg):
    assert cfg.target.model == "moonshotai/Kimi-K2.5"
    assert cfg.target.engine == "sglang" and cfg.target.device == "cuda"
    assert cfg.target.sglang.tp_size == 8
    assert cfg.regen.num_gpus_per_actor == cfg.target.sglang.tp_size == cfg.serve.num_gpus_per_replica
    assert cfg.train.drafter.draft_vocab_size == 32000
    assert cfg.train.ttt_steps == 7
    assert cfg.serve.spec == SpecConfig(algorithm="EAGLE3", num_steps=3, topk=1, num_draft_tokens=4)
    assert all(s.algorithm == "EAGLE3" for s in cfg.bench.sweep)
    assert cfg.serve.host == "127.0.0.1"


def test_yaml_agrees_with_the_target(cfg, kimi):
    assert cfg.target.aux_layer_ids == layers.default_aux_layer_ids(kimi.num_layers)
    assert cfg.plan.hidden_size == kimi.hidden_size  # `eaglenest plan` works offline from the yaml's copy
    assert cfg.target.sglang.context_length <= kimi.max_position_embeddings
    assert cfg.train.drafter.draft_vocab_size <= kimi.vocab_size
    assert cfg.target.dtype == "auto"  # keep the checkpoint's own: bf16 with INT4 (compressed-tensors) experts


def test_taps_match_the_target_and_sglangs_rules(cfg, kimi):
    n = kimi.num_layers
    assert cfg.target.aux_layer_ids == layers.default_aux_layer_ids(n) == [2, 30, 58]
    assert layers.validate_aux_layer_ids(cfg.target.aux_layer_ids, n) == [2, 30, 58]
    wrapper, llama = kimi.architecture, "LlamaForCausalLM"
    sglang_ids = layers.engine_layer_ids(cfg.target.aux_layer_ids, engine="sglang", architecture=wrapper, num_layers=n)
    assert sglang_ids == [1, 29, 57]
    # Kimi-K2.5 is a DeepSeek-family target: SGLang >= 0.5.14 adds its +1 only when the first id is 1, and
    # 0.5.10 always adds it; [1, 29, 57] therefore captures the trained taps under both rules
    assert layers.engine_captured_layers(sglang_ids, engine="sglang", architecture=wrapper, num_layers=n) == [2, 30, 58]
    assert layers.engine_captured_layers(sglang_ids, engine="sglang", architecture=llama, num_layers=n) == [2, 30, 58]
    # the tempting alternative, writing the physical ids into the drafter config, is off by one on llama-rule
    # engines: exactly the class of silent mismatch preflight exists for
    assert layers.engine_captured_layers([2, 30, 58], engine="sglang", architecture=llama,
                                         num_layers=n) == [3, 31, 59]


def test_taps_out_of_range_for_the_target_are_refused(kimi):
    with pytest.raises(layers.LayerIdError, match=r"\[61\] are out of range for a 61-layer target.*1\.\.60"):
        layers.validate_aux_layer_ids([2, 30, 61], kimi.num_layers)


def test_fc_input_and_storage_bytes(cfg, kimi):
    hidden = kimi.hidden_size
    fc_in = len(cfg.target.aux_layer_ids) * hidden
    assert fc_in == 21504  # what SGLang feeds the drafter's fc under EAGLE3 (EAGLE feeds 7168: the incident)
    bytes_per_value = {"bfloat16": 2, "float16": 2, "float32": 4}[cfg.regen.storage_dtype]
    assert (fc_in + hidden) * bytes_per_value == 8 * hidden == 57344  # aux + final state, per token


def test_lengths_fit_the_engine_and_the_drafter(cfg, kimi):
    ctx = cfg.target.sglang.context_length
    target_ctx = kimi.max_position_embeddings
    assert ctx <= target_ctx
    assert cfg.serve.max_prompt_tokens + cfg.serve.max_tokens_limit <= ctx
    assert cfg.regen.max_tokens <= ctx
    assert cfg.train.max_seq_len >= cfg.regen.max_tokens, "captured tokens beyond max_seq_len would be wasted"
    drafter_ctx = cfg.train.drafter.max_position_embeddings or target_ctx
    assert drafter_ctx >= ctx, "SGLang refuses a drafter whose max_position_embeddings is below the context length"
    assert cfg.serve.self_test_min_accept_length > 1.0, "the self-test must catch a bypassed drafter (1.0)"


def test_sources_cover_every_domain(cfg):
    domains = {s.domain for s in cfg.regen.sources}
    assert domains == {"chat", "reasoning", "math", "coding", "agentic_coding", "tool_use"}
    assert len(cfg.regen.sources) == 10 and all(s.hub_id for s in cfg.regen.sources)
    assert len({s.name for s in cfg.regen.sources}) == 10
    assert 50_000 <= sum(s.max_samples for s in cfg.regen.sources) <= 120_000


def test_every_value_is_explained():
    """Each `key: value` line carries a comment, or follows a comment line that explains it."""
    lines = KIMI.read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^\s*[a-z_]+: \S", line) and "#" not in line:
            assert lines[i - 1].lstrip().startswith("#"), f"line {i + 1} has no explanation: {line.strip()}"
