"""A tiny MLA-shaped EAGLE-3 drafter (draft_shape: mla) shared by the MLA tests and the SGLang contract test."""

from __future__ import annotations

import torch

from eaglenest.drafters.eagle3.config import DrafterModelConfig
from eaglenest.drafters.eagle3.model import Eagle3Drafter
from eaglenest.drafters.vocab import build_vocab_mapping

H, HEADS, V, VD = 32, 4, 64, 24
QA, KVA, NOPE, ROPE, VH = 20, 12, 6, 4, 5
THETA = 100.0

MLA_NAMES = {  # what SGLang's Eagle3DeepseekV2ForCausalLM.load_weights maps (kimi_k25_eagle3.py), with shapes
    "fc.weight": (H, 3 * H),
    "midlayer.self_attn.q_a_proj.weight": (QA, 2 * H),
    "midlayer.self_attn.q_a_layernorm.weight": (QA,),
    "midlayer.self_attn.q_b_proj.weight": (HEADS * (NOPE + ROPE), QA),
    "midlayer.self_attn.kv_a_proj_with_mqa.weight": (KVA + ROPE, 2 * H),
    "midlayer.self_attn.kv_a_layernorm.weight": (KVA,),
    "midlayer.self_attn.kv_b_proj.weight": (HEADS * (NOPE + VH), KVA),
    "midlayer.self_attn.o_proj.weight": (H, HEADS * VH),
    "midlayer.mlp.gate_proj.weight": (48, H),
    "midlayer.mlp.up_proj.weight": (48, H),
    "midlayer.mlp.down_proj.weight": (H, 48),
    "midlayer.input_layernorm.weight": (H,),
    "midlayer.hidden_norm.weight": (H,),
    "midlayer.post_attention_layernorm.weight": (H,),
    "norm.weight": (H,),
    "lm_head.weight": (VD, H),
    "d2t": (VD,),
    "t2d": (V,),
}


def mla_config(**kw) -> DrafterModelConfig:
    base = dict(hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=HEADS, head_dim=NOPE + ROPE,
                intermediate_size=48, vocab_size=V, draft_vocab_size=VD, aux_layer_ids=[2, 4, 5],
                target_hidden_size=H, target_num_layers=8, rope_theta=THETA, max_position_embeddings=512,
                target_architecture="DeepseekV3ForCausalLM", draft_shape="mla", q_lora_rank=QA, kv_lora_rank=KVA,
                qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=VH)
    base.update(kw)
    return DrafterModelConfig(**base)


def mla_drafter(seed: int = 0, **kw) -> tuple[Eagle3Drafter, object, torch.Tensor]:
    torch.manual_seed(seed)
    cfg = mla_config(**kw)
    mapping = build_vocab_mapping(torch.randint(0, 50, (V,)), VD)
    lm_head = torch.randn(V, H)
    lm_head[mapping.draft_ids] *= 1.6
    m = Eagle3Drafter(cfg)
    m.init_from_target(torch.randn(V, H), lm_head, mapping.d2t, mapping.t2d)
    with torch.no_grad():  # non-trivial norm weights so a swapped norm would show
        for name, p in m.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return m, mapping, lm_head
