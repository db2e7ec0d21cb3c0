"""The Kimi-shaped (DeepseekV3) stand-in: the function-preserving widening of MLA + MoE, its controls, and a tiny CPU
build through the CLI that transformers and TargetSpec read."""

from __future__ import annotations

import json
import math

import pytest
import torch

from eaglenest.engines.widen import WidenError, layer_positions
from eaglenest.engines.widen_deepseek import (
    KIMI_K25_ROUTED_EXPERTS,
    NEVER_ROUTED_BIAS,
    DeepseekWideShape,
    deepseek_parameters,
    softmax_scale,
    widen_deepseek_config,
    widen_deepseek_state_dict,
)

SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=16,
             qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
             first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=2.5, max_position_embeddings=128,
             rms_norm_eps=1e-6, tie_word_embeddings=False, num_nextn_predict_layers=0,
             rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                              "rope_theta": 10000.0, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0,
                              "beta_slow": 1.0})
WIDE = DeepseekWideShape(hidden_size=128, num_layers=5, num_heads=8, q_lora_rank=32, kv_lora_rank=64,
                         qk_nope_head_dim=32, qk_rope_head_dim=8, v_head_dim=24, intermediate_size=160,
                         moe_intermediate_size=48, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                         first_k_dense_replace=1, vocab_size=384, routed_scaling_factor=2.827)


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: more threads only contend on a shared machine
    yield
    torch.set_num_threads(threads)


def _small_model():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    m = DeepseekV3ForCausalLM(DeepseekV3Config(**SMALL)).float().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # norms away from 1, so a wrong rescale shows
        for mod in m.modules():
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.normal_(0, 0.05)
    return m


def _write(folder, sd, cfg):
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "float32"}))
    return folder


def _load(folder):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not any(info.values()), info  # every tensor written is read, every one read was written
    return model.float().eval()


def _wide(tmp_path, small, mutate=None):
    cfg = widen_deepseek_config(small.config.to_dict(), WIDE)
    sd = widen_deepseek_state_dict(small.state_dict(), small.config.to_dict(), WIDE, dtype=torch.float32)
    if mutate:
        mutate(sd)
    return _load(_write(tmp_path / "wide", sd, cfg)), cfg


X = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(1))


def test_widened_deepseek_computes_the_same_function(tmp_path):
    small = _small_model()
    wide, cfg = _wide(tmp_path, small)
    assert type(wide).__name__ == "DeepseekV3ForCausalLM"
    n_bias = sum(b.numel() for n, b in wide.named_buffers() if n.endswith("e_score_correction_bias"))
    assert sum(p.numel() for p in wide.parameters()) + n_bias == deepseek_parameters(cfg)["total"]
    chosen: dict[int, list[torch.Tensor]] = {}
    for i, layer in enumerate(wide.model.layers):
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.register_forward_hook(lambda _m, _a, out, i=i: chosen.setdefault(i, []).append(out[2]))
    with torch.no_grad():
        a = small(X, output_hidden_states=True)
        b = wide(X, output_hidden_states=True)
    assert (a.logits - b.logits[..., :300]).abs().max() < 1e-4  # MLA, routing, shared expert: the same function
    assert torch.equal(b.logits[..., 300:], torch.zeros_like(b.logits[..., 300:]))  # pad ids: exactly 0
    c = math.sqrt(128 / 64)  # the residual stream is carried scaled by sqrt(H / h), its new channels stay 0
    pos = layer_positions(2, 5)
    assert (a.hidden_states[1] * c - b.hidden_states[pos[0] + 1][..., :64]).abs().max() < 1e-4
    assert b.hidden_states[pos[0] + 1][..., 64:].abs().max() == 0
    experts_at = set(layer_positions(4, 8))
    for i in range(1, 5):  # every MoE layer (real or identity) chooses among the small model's experts only
        assert set(torch.cat(chosen[i]).flatten().tolist()) <= experts_at


def _undo(name, factor):
    def mutate(sd):
        sd[name] = sd[name] * factor
    return mutate


@pytest.mark.parametrize("what, mutate", [
    ("q_a_layernorm rescale", _undo("model.layers.0.self_attn.q_a_layernorm.weight", math.sqrt(32 / 16))),
    ("kv_a_layernorm rescale", _undo("model.layers.2.self_attn.kv_a_layernorm.weight", math.sqrt(64 / 16))),
    ("softmax-scale compensation", _undo("model.layers.2.self_attn.q_b_proj.weight",
                                         softmax_scale({**SMALL, "qk_nope_head_dim": 32})
                                         / softmax_scale(SMALL))),
    ("routed_scaling_factor compensation", lambda sd: [sd.__setitem__(k, v * 2.827 / 2.5) for k, v in sd.items()
                                                       if ".mlp.experts." in k and k.endswith("down_proj.weight")]),
    ("never-routed bias", lambda sd: sd["model.layers.2.mlp.gate.e_score_correction_bias"].clamp_(min=0.0)),
])
def test_a_wrong_rescale_would_be_seen(tmp_path, what, mutate):
    """Controls: each compensation, undone alone, changes the logits (so the check above can fail)."""
    small = _small_model()
    wide, _ = _wide(tmp_path, small, mutate)
    with torch.no_grad():
        assert (small(X).logits - wide(X).logits[..., :300]).abs().max() > 1e-3, what


def test_widen_deepseek_refuses_shapes_it_cannot_preserve():
    from dataclasses import replace

    with pytest.raises(WidenError, match="qk_rope_head_dim"):
        widen_deepseek_config(SMALL, replace(WIDE, qk_rope_head_dim=16))
    with pytest.raises(WidenError, match="num_experts_per_tok"):
        widen_deepseek_config(SMALL, replace(WIDE, num_experts_per_tok=8))
    with pytest.raises(WidenError, match="fewer layers"):
        widen_deepseek_config(SMALL, replace(WIDE, num_layers=1))
    with pytest.raises(WidenError, match="narrower"):
        widen_deepseek_config(SMALL, replace(WIDE, kv_lora_rank=8))
    with pytest.raises(WidenError, match="other kind"):
        widen_deepseek_config({**SMALL, "first_k_dense_replace": 0}, WIDE)


def test_kimi_widths_sizes_and_sglang_keys():
    from eaglenest.contracts.target import TargetSpec
    from eaglenest.engines.standin_deepseek import DeepseekStandinSpec, size_report, small_config, with_experts
    from eaglenest.targets import SGLANG_MOE_KEYS, default_aux_taps

    spec = DeepseekStandinSpec()

    class Tok:
        bos_token_id, eos_token_id, pad_token_id = 1, 2, 0

        def __len__(self):
            return 32000

    cfg = widen_deepseek_config(small_config(spec, Tok()).to_dict(), spec.wide)
    for k, v in dict(hidden_size=7168, vocab_size=163840, num_attention_heads=64, q_lora_rank=1536, kv_lora_rank=512,
                     qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, num_hidden_layers=61,
                     first_k_dense_replace=1, moe_intermediate_size=2048, n_shared_experts=1, num_experts_per_tok=8,
                     topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1, n_group=1, topk_group=1,
                     num_nextn_predict_layers=0, rope_theta=50000.0).items():
        assert cfg[k] == v, k
    assert set(SGLANG_MOE_KEYS) <= set(cfg)
    ts = TargetSpec.from_config(cfg)
    assert ts.arch.name == "deepseek_v3" and default_aux_taps(ts.num_layers) == [2, 30, 58]
    kimi = deepseek_parameters({**cfg, "n_routed_experts": KIMI_K25_ROUTED_EXPERTS})
    assert 1.0e12 < kimi["total"] < 1.05e12 and 31e9 < kimi["active_per_token"] < 33e9  # "1T total, 32B active"
    eight = size_report(spec)
    assert 65e9 < eight["bytes"] < 66e9 and eight["active_per_token"] == pytest.approx(kimi["active_per_token"],
                                                                                       rel=0.01)
    four = with_experts(spec, 4, 4)
    assert four.n_routed_experts == 4 and four.num_experts_per_tok == 4 and four.wide.num_experts_per_tok == 4
    assert 44e9 < size_report(four)["bytes"] < 45e9
    with pytest.raises(ValueError, match="at least 8"):
        with_experts(spec, 4)
    assert NEVER_ROUTED_BIAS < -10


def test_small_preset_widths_taps_and_size(capsys):
    """``--preset small``: hidden 4096, 32 layers (taps [2, 16, 29]), Kimi's MLA head dims and ranks, every width
    grown 4x from the small model (so every rescale is a power of two); 13.3 GB with 4 experts, 4 per token."""
    from eaglenest.cli import main
    from eaglenest.contracts.target import TargetSpec
    from eaglenest.engines.standin_deepseek import SMALL_DEEPSEEK, _Vocab, size_report, small_config, with_experts
    from eaglenest.targets import default_aux_taps

    spec = with_experts(SMALL_DEEPSEEK, 4, 4)
    cfg = widen_deepseek_config(small_config(spec, _Vocab(32000)).to_dict(), spec.wide)
    for k, v in dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, q_lora_rank=1536,
                     kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=163840,
                     moe_intermediate_size=2048, n_routed_experts=4, num_experts_per_tok=4).items():
        assert cfg[k] == v, k
    for k in ("hidden_size", "q_lora_rank", "kv_lora_rank"):
        assert cfg[k] == 4 * getattr(spec, k), k
    assert cfg["num_attention_heads"] == 4 * spec.num_heads
    ts = TargetSpec.from_config(cfg)
    assert ts.arch.name == "deepseek_v3" and default_aux_taps(ts.num_layers) == [2, 16, 29]
    assert 13e9 < size_report(spec)["bytes"] < 13.6e9
    assert main(["standin-target", "unused", "--arch", "deepseek_v3", "--preset", "small", "--routed-experts", "4",
                 "--experts-per-token", "4", "--size-only"]) == 0
    assert "13.3 GB" in capsys.readouterr().out


def test_tiny_deepseek_build_on_cpu_end_to_end(tmp_path, capsys):
    """``eaglenest standin-target --arch deepseek_v3 --preset tiny`` on the CPU: pre-training on the padded vocabulary,
    the shard-by-shard write with its layer-by-layer check, and a folder transformers and TargetSpec read."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eaglenest.cli import main
    from eaglenest.contracts.target import TargetSpec
    from eaglenest.engines.base import render_chat_ids
    from eaglenest.targets import SGLANG_MOE_KEYS

    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wizards"]
    recs = [{"id": f"rec{i}", "conversations": [
        {"from": "human", "value": f"Question {i}: " + " ".join(words[(i + k) % 12] for k in range(6 + i % 5))},
        {"from": "gpt", "value": "Answer: " + " ".join(words[(2 * i + k) % 12] for k in range(12))}]}
        for i in range(120)]
    dump = tmp_path / "dump.json"
    dump.write_text(json.dumps(recs))
    out = tmp_path / "out"
    assert main(["standin-target", str(out), "--sharegpt", str(dump), "--arch", "deepseek_v3", "--preset", "tiny",
                 "--device", "cpu", "--train-prompts", "20", "--heldout-prompts", "5"]) == 0
    assert "8 routed experts, 2 per token" in capsys.readouterr().out
    rep = json.loads((out / "standin.json").read_text())
    pres = rep["preservation"]
    assert pres["max_abs_logit_diff"] < 1e-4 and pres["top1_agreement"] == 1.0 and pres["pad_logits_all_zero"]
    assert rep["pretrain"]["loss_curve"][-1] < rep["pretrain"]["loss_curve"][0]
    index = json.loads((out / "model/model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((out / "model" / s).is_file() for s in shards)
    assert index["metadata"]["total_size"] == rep["wide"]["bytes_written"]
    cfg = json.loads((out / "model/config.json").read_text())
    assert set(SGLANG_MOE_KEYS) <= set(cfg) and cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    ts = TargetSpec.read(out / "model")
    assert (ts.architecture, ts.num_layers, ts.hidden_size, ts.vocab_size) == ("DeepseekV3ForCausalLM", 5, 128, 1024)
    assert ts.arch.name == "deepseek_v3"

    tok = AutoTokenizer.from_pretrained(out / "model")
    base = AutoModelForCausalLM.from_pretrained(out / "base").eval()
    wide, info = AutoModelForCausalLM.from_pretrained(out / "model", output_loading_info=True)
    assert not any(info.values()), info
    held = [json.loads(x) for x in (out / "prompts/heldout.jsonl").read_text().splitlines()]
    ids = torch.tensor([render_chat_ids(tok, held[0]["messages"], add_generation_prompt=True)])
    with torch.no_grad():
        a = base(ids).logits
        b = wide.eval()(ids).logits
    assert (a - b[..., :a.shape[-1]]).abs().max() < 1e-4


def test_padded_vocab_loss_is_the_padded_models_cross_entropy():
    """Pre-training's loss is exactly the cross entropy of the wide-vocabulary model whose pad rows are zero."""
    import torch.nn.functional as F

    from eaglenest.engines.standin_deepseek import padded_vocab_loss

    small = _small_model()
    batch = X[:, :12]
    with torch.no_grad():
        logits = small(batch).logits[:, :-1]
        padded = torch.cat([logits, torch.zeros(*logits.shape[:2], 84)], -1)  # 300 real ids + 84 pad ids at logit 0
        want = F.cross_entropy(padded.reshape(-1, 384), batch[:, 1:].reshape(-1))
        assert padded_vocab_loss(84)(small, batch) == pytest.approx(float(want), rel=1e-5)
        assert padded_vocab_loss(0)(small, batch) == pytest.approx(float(small(batch, labels=batch).loss), rel=1e-5)
