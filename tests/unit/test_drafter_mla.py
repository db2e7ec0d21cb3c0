"""The MLA draft shape (drafters/eagle3/mla.py): its forward against a direct per-token computation, the TTT objective
against the same unroll run through the decoder's ``step``, and its export (config keys, tensor names and shapes that
SGLang 0.5.14's Eagle3DeepseekV2ForCausalLM loads; tests/unit/test_sglang_contract.py checks them against SGLang)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from mla_helpers import HEADS, KVA, MLA_NAMES, NOPE, QA, ROPE, THETA, VD, VH, H, V, mla_config, mla_drafter

from eaglenest.contracts.target import TargetSpec
from eaglenest.drafter.shape import drafter_model_config
from eaglenest.drafters.eagle3.format import ExportError, read_drafter, validate_tensors
from eaglenest.drafters.eagle3.model import Eagle3Drafter, load_drafter
from eaglenest.drafters.eagle3.ttt import TeacherHead, TTTObjective, shift_left


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return w * x / torch.sqrt((x * x).mean() + eps)


def rope_pairs(x: torch.Tensor, pos: int) -> torch.Tensor:
    """Interleaved RoPE of one vector as complex numbers: (x[2i] + i x[2i+1]) * exp(i pos theta^(-2i/d))."""
    d = x.numel()
    z = torch.complex(x[0::2].double(), x[1::2].double())
    ang = torch.tensor([pos * THETA ** (-2 * i / d) for i in range(d // 2)], dtype=torch.float64)
    z = z * torch.polar(torch.ones_like(ang), ang)
    return torch.stack([z.real, z.imag], dim=-1).flatten().to(x.dtype)


def reference_forward(m: Eagle3Drafter, ids: list[int], aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, token by token, straight from the weights (no module forward but linears' weights)."""
    sd = {k: v.detach() for k, v in m.state_dict().items()}
    a = "midlayer.self_attn."
    keys, vals, logits, outs = [], [], [], []
    for t, tok in enumerate(ids):
        if m.config.fc_norm:
            chunks = aux[t].chunk(3)
            x_aux = torch.cat([rms(c, sd[f"fc_norm.{i}.weight"]) for i, c in enumerate(chunks)])
        else:
            x_aux = aux[t]
        h = sd["fc.weight"] @ x_aux
        e = sd["embed_tokens.weight"][tok]
        x = torch.cat([rms(e, sd["midlayer.input_layernorm.weight"]), rms(h, sd["midlayer.hidden_norm.weight"])])
        q_lat = sd[f"{a}q_a_proj.weight"] @ x
        q = (sd[f"{a}q_b_proj.weight"] @ rms(q_lat, sd[f"{a}q_a_layernorm.weight"])).view(HEADS, NOPE + ROPE)
        latent = sd[f"{a}kv_a_proj_with_mqa.weight"] @ x
        kv = (sd[f"{a}kv_b_proj.weight"] @ rms(latent[:KVA], sd[f"{a}kv_a_layernorm.weight"])).view(HEADS, NOPE + VH)
        k_pe = rope_pairs(latent[KVA:], t)
        keys.append([torch.cat([kv[j, :NOPE], k_pe]) for j in range(HEADS)])
        vals.append([kv[j, NOPE:] for j in range(HEADS)])
        heads = []
        for j in range(HEADS):
            qj = torch.cat([q[j, :NOPE], rope_pairs(q[j, NOPE:], t)])
            w = torch.softmax(torch.stack([qj @ keys[s][j] for s in range(t + 1)]) / math.sqrt(NOPE + ROPE), 0)
            heads.append(sum(w[s] * vals[s][j] for s in range(t + 1)))
        r = h + sd[f"{a}o_proj.weight"] @ torch.cat(heads)
        u = rms(r, sd["midlayer.post_attention_layernorm.weight"])
        mlp = sd["midlayer.mlp.down_proj.weight"] @ (torch.nn.functional.silu(sd["midlayer.mlp.gate_proj.weight"] @ u)
                                                     * (sd["midlayer.mlp.up_proj.weight"] @ u))
        out = r + mlp
        normed = rms(out, sd["norm.weight"])
        logits.append(sd["lm_head.weight"] @ normed)
        outs.append(normed if m.config.norm_output else out)
    return torch.stack(logits), torch.stack(outs)


@pytest.mark.parametrize("eagle31", [False, True])
def test_mla_forward_matches_direct_computation(eagle31: bool) -> None:
    m, _, _ = mla_drafter(1, fc_norm=eagle31, norm_output=eagle31)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, V, (2, 6), generator=g)
    aux = torch.randn(2, 6, 3 * H, generator=g)
    pos = torch.arange(6).expand(2, 6)
    logits, hidden = m.step(ids, aux, pos)
    for b in range(2):
        ref_logits, ref_hidden = reference_forward(m, ids[b].tolist(), aux[b])
        torch.testing.assert_close(logits[b], ref_logits, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(hidden[b], ref_hidden, rtol=1e-4, atol=1e-5)
    # incremental decoding with the KV cache gives the same positions
    cache = m.new_cache()
    first, _ = m.step(ids[:, :4], aux[:, :4], pos[:, :4], cache)
    rest, _ = m.step(ids[:, 4:], aux[:, 4:], pos[:, 4:], cache)
    torch.testing.assert_close(torch.cat([first, rest], 1), logits, rtol=1e-5, atol=1e-6)
    assert cache.k.shape == (2, HEADS, 6, NOPE + ROPE) and cache.v.shape == (2, HEADS, 6, VH)


def ttt_through_step(m: Eagle3Drafter, ids, aux, targets, steps: int, decay: float) -> torch.Tensor:
    """The TTT unroll as the reference decoder would run it: ``step`` with a KV cache and an explicit mask."""
    b, t = ids.shape
    pos = torch.arange(t).expand(b, t)
    cache, hidden = m.new_cache(), aux
    causal, eye = torch.ones(t, t, dtype=torch.bool).tril(), torch.eye(t, dtype=torch.bool)
    loss = torch.zeros(())
    for k in range(steps):
        mask = torch.cat([causal] + [eye] * k, dim=1) if k else None
        logits, hidden = m.step(shift_left(ids, 1 + k), hidden, pos + k, cache, attention_mask=mask, fused=k == 0)
        n = t - 1 - k
        if n <= 0:
            continue
        valid = targets.valid[:, 1 + k:]
        ce = -(targets.probs[:, 1 + k:] * logits[:, :n].float().log_softmax(-1)).sum(-1)
        loss = loss + decay ** k * torch.where(valid, ce, 0.0).sum() / valid.sum().clamp(min=1)
    return loss


@pytest.mark.parametrize("eagle31", [False, True])
def test_mla_ttt_objective_matches_the_unroll_through_step(eagle31: bool) -> None:
    m, mapping, lm_head = mla_drafter(3, fc_norm=eagle31, norm_output=eagle31)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, V, (2, 9), generator=g)
    aux, last = torch.randn(2, 9, 3 * H, generator=g), torch.randn(2, 9, H, generator=g)
    mask = torch.ones(2, 9, dtype=torch.int8)
    mask[:, :2] = 0
    targets = TeacherHead(lm_head, mapping)(last, mask, torch.tensor([9, 9]))
    out = TTTObjective(m, ttt_steps=3, decay=0.8, attention="manual", loss_kernel="eager")(ids, aux, targets)
    ref = ttt_through_step(m, ids, aux, targets, 3, 0.8)
    torch.testing.assert_close(out.loss, ref, rtol=1e-5, atol=1e-6)
    out.loss.backward()
    assert m.midlayer.self_attn.kv_b_proj.weight.grad.abs().sum() > 0


def test_mla_export_is_what_sglangs_loader_maps(tmp_path: Path) -> None:
    m, _, _ = mla_drafter(5)
    out = m.save_pretrained(tmp_path / "mla", dtype="float32", include_embedding=False)
    hf = json.loads((out / "config.json").read_text())
    assert hf["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and hf["model_type"] == "deepseek_v3"
    assert {k: hf[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")} \
        == {"q_lora_rank": QA, "kv_lora_rank": KVA, "qk_nope_head_dim": NOPE, "qk_rope_head_dim": ROPE,
            "v_head_dim": VH}
    assert hf["num_hidden_layers"] == 1 and hf["num_attention_heads"] == HEADS == hf["num_key_value_heads"]
    assert hf["rope_interleave"] is True and hf["rope_theta"] == THETA and hf["rope_scaling"] is None
    assert hf["draft_vocab_size"] == VD and hf["vocab_size"] == V and hf["tie_word_embeddings"] is False
    assert hf["hidden_act"] == "silu" and "num_nextn_predict_layers" not in hf
    assert hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # DeepSeek first-id rule -> 2, 4, 5
    assert "fc_norm" not in hf and "norm_output" not in hf
    d = read_drafter(out)
    assert d.draft_shape == "mla" and d.is_eagle3 and d.prefixed_tensors == []
    assert {k: tuple(e.shape) for k, e in d.tensors.items()} == MLA_NAMES
    again = load_drafter(out, target_embedding=m.embed_tokens.weight.detach())
    ids, aux = torch.randint(0, V, (1, 5)), torch.randn(1, 5, 3 * H)
    pos = torch.arange(5)[None]
    torch.testing.assert_close(again.step(ids, aux, pos)[0], m.step(ids, aux, pos)[0])


def test_eagle31_export_adds_its_keys_and_norms(tmp_path: Path) -> None:
    m, _, _ = mla_drafter(6, fc_norm=True, norm_output=True)
    out = m.save_pretrained(tmp_path / "mla31", dtype="float32")
    hf = json.loads((out / "config.json").read_text())
    assert hf["fc_norm"] is True and hf["norm_output"] is True
    shapes = {k: tuple(e.shape) for k, e in read_drafter(out).tensors.items()}
    assert {k: shapes[k] for k in ("fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight")} == {
        f"fc_norm.{i}.weight": (H,) for i in range(3)}


def test_validation_refuses_a_missing_or_misshaped_mla_tensor() -> None:
    m, _, _ = mla_drafter(7)
    tensors = dict(m.state_dict())
    ok = dict(tensors)
    validate_tensors(ok, m.config)
    del ok["midlayer.self_attn.kv_a_layernorm.weight"]
    with pytest.raises(ExportError, match="kv_a_layernorm"):
        validate_tensors(ok, m.config)
    wrong = dict(tensors)
    wrong["midlayer.self_attn.q_proj.weight"] = torch.zeros(HEADS * 8, 2 * H)  # a llama tensor in an MLA export
    with pytest.raises(ExportError, match="unexpected tensors"):
        validate_tensors(wrong, m.config)


def test_config_refuses_incomplete_mla_widths_and_mla_widths_on_llama() -> None:
    with pytest.raises(ValueError, match="q_lora_rank"):
        mla_config(q_lora_rank=None)
    with pytest.raises(ValueError, match="one key/value head per query head"):
        mla_config(num_key_value_heads=2)
    with pytest.raises(ValueError, match="MLA widths"):
        mla_config(draft_shape="llama")
    with pytest.raises(ValueError, match="draft_shape"):
        mla_config(draft_shape="gqa")


def test_drafter_config_takes_mla_widths_from_the_kimi_text_config(tmp_path: Path) -> None:
    text = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "num_hidden_layers": 61,
            "hidden_size": 7168, "intermediate_size": 18432, "num_attention_heads": 64, "vocab_size": 163840,
            "max_position_embeddings": 262144, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64, "v_head_dim": 128, "rope_theta": 50000.0}
    folder = tmp_path / "kimi"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["KimiK25ForConditionalGeneration"],
                                                    "model_type": "kimi_k25", "text_config": text}))
    facts = TargetSpec.read(folder)
    cfg = drafter_model_config(facts, [2, 30, 58], 32000, draft_shape="mla", mla={"q_lora_rank": 768})
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (
        768, 512, 128, 64, 128)
    assert cfg.num_key_value_heads == cfg.num_attention_heads == 64 and cfg.head_dim == 192
    assert cfg.target_architecture == "KimiK25ForConditionalGeneration"
    llama = drafter_model_config(facts, [2, 30, 58], 32000)
    assert llama.draft_shape == "llama" and llama.q_lora_rank is None
    gqa = TargetSpec(num_layers=8, hidden_size=64, vocab_size=100, architecture="LlamaForCausalLM",
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128)
    with pytest.raises(ValueError, match="not an MLA target"):
        drafter_model_config(gqa, [2, 4, 5], 50, draft_shape="mla", text_config={"hidden_size": 64})


def test_train_section_passes_the_draft_shape() -> None:
    from eaglenest.config import DrafterConfig

    kw = DrafterConfig(draft_shape="mla", q_lora_rank=64, fc_norm=True).shape_kwargs()
    assert kw["draft_shape"] == "mla" and kw["mla"]["q_lora_rank"] == 64 and kw["mla"]["kv_lora_rank"] is None
    assert kw["fc_norm"] is True and kw["norm_output"] is False
    assert DrafterConfig().shape_kwargs() == {"draft_shape": "llama", "mla": None, "fc_norm": False,
                                              "norm_output": False}
    with pytest.raises(ValueError, match="draft_shape: mla"):
        DrafterConfig(kv_lora_rank=512).shape_kwargs()
