"""An MLA-shaped drafter in the reference speculative decoder (chain and tree drafting: its KV cache rolled back,
kept by path and padded with a value width other than the key width): every output stays the target's own.

The tiny target is Llama-shaped, so the MLA widths are given by hand (preflight would refuse this pairing for
serving, tests/unit/test_mla_preflight.py); the decoder itself is shape-agnostic, which is what is checked here.
"""

from __future__ import annotations

import torch

from eaglenest.config import SpecConfig
from eaglenest.contracts.layers import default_aux_layer_ids
from eaglenest.contracts.target import TargetSpec
from eaglenest.drafter.shape import drafter_model_config
from eaglenest.drafters.eagle3.model import Eagle3Drafter
from eaglenest.drafters.vocab import build_vocab_mapping
from eaglenest.engines.base import SamplingParams


def test_mla_drafter_outputs_stay_the_targets(tiny_engine, tiny_target_path):
    from eaglenest.speculative.decoder import SpecDecoder

    facts = TargetSpec.read(tiny_target_path)
    widths = {"q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6}
    cfg = drafter_model_config(facts, default_aux_layer_ids(facts.num_layers), min(64, facts.vocab_size),
                               draft_shape="mla", mla=widths, norm_output=True)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg)
    mapping = build_vocab_mapping(torch.arange(facts.vocab_size).flip(0), cfg.draft_vocab_size)
    drafter.init_from_target(tiny_engine.embed_weight().float().cpu(), tiny_engine.lm_head_weight().float().cpu(),
                             mapping.d2t, mapping.t2d)
    prompts = [tiny_engine.render_prompt([{"role": "user", "content": c}]) for c in ("count to five", "hi there")]
    sp = SamplingParams(max_new_tokens=16)
    ref = [g.token_ids for g in tiny_engine.generate_ids(prompts, sp)]
    for spec in (SpecConfig(num_steps=3, topk=1, num_draft_tokens=4), SpecConfig(num_steps=3, topk=3,
                                                                                  num_draft_tokens=7)):
        got = SpecDecoder.from_engine(tiny_engine, drafter, spec).generate(prompts, sp)
        assert [g.token_ids for g in got] == ref, spec
