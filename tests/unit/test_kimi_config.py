"""configs/kimi-k25.yaml: loads with eaglenest's config models, and its layer taps, engine shape and lengths are
consistent with a Kimi-K2.5-shaped target (61 layers, hidden 7168) under SGLang's layer-id rules."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from eaglenest.config import EaglenestConfig, SpecConfig, load_config
from eaglenest.contracts import layers

REPO = Path(__file__).resolve().parents[2]
KIMI = REPO / "configs" / "kimi-k25.yaml"


@pytest.fixture(scope="module")
def cfg() -> EaglenestConfig:
    return load_config(KIMI)


@pytest.fixture(scope="module")
def kimi_config_json(tmp_path_factory) -> dict:
    """A config.json shaped like moonshotai/Kimi-K2.5's (the text model's shape sits under text_config)."""
    conf = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "kimi_k2",
            "num_hidden_layers": 61,
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "num_attention_heads": 64,
            "vocab_size": 163840,
            "max_position_embeddings": 262144,
        },
    }
    path = tmp_path_factory.mktemp("kimi") / "config.json"
    path.write_text(json.dumps(conf))
    return json.loads(path.read_text())


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


def test_taps_match_the_target_and_sglangs_rules(cfg, kimi_config_json):
    text = kimi_config_json["text_config"]
    n = text["num_hidden_layers"]
    assert cfg.target.aux_layer_ids == layers.default_aux_layer_ids(n) == [2, 30, 58]
    assert layers.validate_aux_layer_ids(cfg.target.aux_layer_ids, n) == [2, 30, 58]
    kimi, llama = "KimiK25ForConditionalGeneration", "LlamaForCausalLM"
    sglang_ids = layers.engine_layer_ids(cfg.target.aux_layer_ids, engine="sglang", architecture=kimi, num_layers=n)
    assert sglang_ids == [1, 29, 57]
    # Kimi-K2.5 is a DeepSeek-family target: SGLang >= 0.5.14 adds its +1 only when the first id is 1, and
    # 0.5.10 always adds it; [1, 29, 57] therefore captures the trained taps under both rules
    assert layers.engine_captured_layers(sglang_ids, engine="sglang", architecture=kimi, num_layers=n) == [2, 30, 58]
    assert layers.engine_captured_layers(sglang_ids, engine="sglang", architecture=llama, num_layers=n) == [2, 30, 58]
    # the tempting alternative, writing the physical ids into the drafter config, is off by one on llama-rule
    # engines: exactly the class of silent mismatch preflight exists for
    assert layers.engine_captured_layers([2, 30, 58], engine="sglang", architecture=llama,
                                         num_layers=n) == [3, 31, 59]


def test_taps_out_of_range_for_the_target_are_refused(kimi_config_json):
    n = kimi_config_json["text_config"]["num_hidden_layers"]
    with pytest.raises(layers.LayerIdError, match="out of range"):
        layers.validate_aux_layer_ids([2, 30, 61], n)


def test_fc_input_and_storage_bytes(cfg, kimi_config_json):
    hidden = kimi_config_json["text_config"]["hidden_size"]
    fc_in = len(cfg.target.aux_layer_ids) * hidden
    assert fc_in == 21504  # what SGLang feeds the drafter's fc under EAGLE3 (EAGLE feeds 7168: the incident)
    bytes_per_value = {"bfloat16": 2, "float16": 2, "float32": 4}[cfg.regen.storage_dtype]
    assert (fc_in + hidden) * bytes_per_value == 8 * hidden == 57344  # aux + final state, per token


def test_lengths_fit_the_engine_and_the_drafter(cfg, kimi_config_json):
    ctx = cfg.target.sglang.context_length
    target_ctx = kimi_config_json["text_config"]["max_position_embeddings"]
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
