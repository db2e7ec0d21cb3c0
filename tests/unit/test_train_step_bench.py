"""benchmarks/train_step.py's figures: its model-FLOP count equals what torch's FlopCounterMode sees a real training
step run (both draft shapes), its kimi preset is Kimi-K2.5's drafter, and its per-kernel breakdown attributes a
step's ops to the right categories. No timing is asserted."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("train_step", ROOT / "benchmarks" / "train_step.py")
train_step = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_step)
import step_profile  # noqa: E402  (benchmarks/, put on sys.path by train_step)

from eaglenest.contracts.target import TargetSpec  # noqa: E402
from eaglenest.drafter.shape import drafter_model_config  # noqa: E402
from eaglenest.drafters.eagle3.ttt import TTTObjective  # noqa: E402

TINY = dict(hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=48, draft_vocab=40, vocab=96, seq_len=12, batch=2,
            q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5)
KIMI_TEXT = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "num_hidden_layers": 61,
             "hidden_size": 7168, "intermediate_size": 18432, "num_attention_heads": 64, "num_key_value_heads": 64,
             "vocab_size": 163840, "max_position_embeddings": 262144, "q_lora_rank": 1536, "kv_lora_rank": 512,
             "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "rope_theta": 50000.0}


def _step(shape: str, k_steps: int = 3):
    p = TINY
    mapping, teacher, _ = train_step.build_teacher(p, torch.device("cpu"), seed=0)
    drafter = train_step.build_drafter(p, shape, mapping, torch.device("cpu"), seed=0)
    objective = TTTObjective(drafter, k_steps, 0.8, attention="manual", loss_kernel="eager")
    b, t = p["batch"], p["seq_len"]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, p["vocab"], (b, t), generator=g)
    aux, last = torch.randn(b, t, 3 * p["hidden"], generator=g), torch.randn(b, t, p["hidden"], generator=g)
    mask, lengths = torch.ones(b, t, dtype=torch.bool), torch.full((b,), t)

    def step() -> torch.Tensor:
        with step_profile.label("teacher"):
            targets = teacher(last, mask, lengths)
        with step_profile.label("forward"):
            out = objective(ids, aux, targets)
        with step_profile.label("backward"):
            out.loss.backward()
        return out.loss.detach()

    return drafter, teacher, step


@pytest.mark.parametrize("shape", ["llama", "mla"])
def test_step_flops_count_every_matmul_the_step_runs(shape: str) -> None:
    k_steps = 3
    drafter, teacher, step = _step(shape, k_steps)
    with FlopCounterMode(display=False) as counter:
        step()
    counted = counter.get_flop_counts()["Global"]
    ours = train_step.step_flops(drafter, teacher.weight, TINY["batch"], TINY["seq_len"], k_steps)
    # every projection / MLP / lm_head / fc / teacher GEMM is an aten.mm (the attention's are bmm or SDPA)
    assert counted[torch.ops.aten.mm] == ours["linear"] + ours["teacher"]
    assert ours["total"] == ours["linear"] + ours["attention"] + ours["teacher"]


def test_mla_flops_come_from_the_mla_projections() -> None:
    mla, teacher, _ = _step("mla")
    llama, _, _ = _step("llama")
    p, tokens, k = TINY, TINY["batch"] * TINY["seq_len"], 3
    h, heads = p["hidden"], p["heads"]
    qk, v = p["qk_nope_head_dim"] + p["qk_rope_head_dim"], p["v_head_dim"]
    attn_macs = (2 * h * (p["q_lora_rank"] + p["kv_lora_rank"] + p["qk_rope_head_dim"])
                 + p["q_lora_rank"] * heads * qk + p["kv_lora_rank"] * heads * (p["qk_nope_head_dim"] + v)
                 + heads * v * h)
    llama_attn_macs = 2 * h * (heads + 2 * p["kv_heads"]) * p["head_dim"] + heads * p["head_dim"] * h
    a = train_step.step_flops(mla, teacher.weight, p["batch"], p["seq_len"], k)
    b = train_step.step_flops(llama, teacher.weight, p["batch"], p["seq_len"], k)
    assert a["linear"] - b["linear"] == 3 * 2 * tokens * k * (attn_macs - llama_attn_macs)
    assert train_step.input_projections(mla) == p["q_lora_rank"] + p["kv_lora_rank"] + p["qk_rope_head_dim"]


def test_kimi_preset_is_kimi_k25s_drafter(tmp_path: Path) -> None:
    folder = tmp_path / "kimi"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["KimiK25ForConditionalGeneration"],
                                                    "model_type": "kimi_k25", "text_config": KIMI_TEXT}))
    built = drafter_model_config(TargetSpec.read(folder), [2, 30, 58], 32000, draft_shape="mla")
    ours = train_step.drafter_config(train_step.PRESETS["kimi"], "mla")
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
            "vocab_size", "draft_vocab_size", "aux_layer_ids", "target_hidden_size", "target_num_layers",
            "rope_theta", "draft_shape", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
            "v_head_dim")
    assert {k: getattr(ours, k) for k in keys} == {k: getattr(built, k) for k in keys}
    assert (ours.q_lora_rank, ours.kv_lora_rank, ours.qk_nope_head_dim, ours.qk_rope_head_dim, ours.v_head_dim,
            ours.num_attention_heads) == (1536, 512, 128, 64, 128, 64)
    llama = train_step.drafter_config(train_step.PRESETS["kimi"], "llama")  # SpecForge's kimi-k25-eagle3 config
    assert (llama.hidden_size, llama.num_attention_heads, llama.num_key_value_heads, llama.head_dim,
            llama.intermediate_size, llama.vocab_size, llama.draft_vocab_size) == (
        7168, 64, 64, 128, 18432, 163840, 32000)


@pytest.mark.parametrize("shape", ["llama", "mla"])
def test_breakdown_attributes_forward_and_backward_ops(shape: str) -> None:
    drafter, _, step = _step(shape)
    res = step_profile.profile_step(step, drafter, torch.device("cpu"), steps=1)
    cats = res["categories"]
    assert set(cats) == set(step_profile.CATEGORIES)
    assert abs(sum(c["ms"] for c in cats.values()) + res["idle_ms"] - res["step_ms"]) < 1e-6
    for name in ("matmul", "attention", "softmax+CE", "norms", "elementwise"):
        assert cats[name]["ms"] > 0, name
    # backward ops inherit their forward op's region (matched by the autograd sequence number)
    for name in ("matmul", "attention", "norms", "softmax+CE"):
        assert 0 < res["backward_ms"][name] < cats[name]["ms"], name
    # the wrappers are gone afterwards
    from eaglenest.drafters.eagle3 import ttt

    assert ttt.ttt_attention.__name__ == "ttt_attention"
    assert not any(m._forward_hooks for m in drafter.modules())


def test_categories_by_name_and_region() -> None:
    c = step_profile.category
    assert c("aten::mm", None, "forward") == "matmul"
    assert c("aten::mm", "attention", "forward") == "attention"
    assert c("aten::mul", "norm", None) == "norms"
    assert c("aten::_fused_adamw_", None, "optimizer") == "optimizer"
    assert c("triton_red_fused__log_softmax_mul_0", "loss", None) == "softmax+CE"
    assert c("aten::argmax", None, "teacher") == "softmax+CE"
    assert c("aten::add_", None, None) == "elementwise"
    assert c("eaglenest:forward", None, "forward") == "other"
    assert c("sm90_xmma_gemm_bf16bf16_bf16f32", None, None) == "matmul"


def test_cuda_breakdown_counts_kernels_once_and_follows_backward_nodes() -> None:
    """The CUDA path on synthetic profiler events: kernel time per launching op, GPU annotation spans and the
    runtime's "Command Buffer Full" stall markers dropped."""
    from types import SimpleNamespace as E

    from torch.autograd import DeviceType

    def op(name, parent=None, kernels=(), seq=-1, annotation=False):
        return E(name=name, cpu_parent=parent, sequence_nr=seq, device_type=DeviceType.CPU, is_async=False,
                 is_user_annotation=annotation, self_cpu_time_total=1.0,
                 kernels=[E(name=n, duration=d) for n, d in kernels])

    fwd = op("eaglenest:forward", kernels=[("eaglenest:forward", 300.0)], annotation=True)
    norm = op("eaglenest:norm", fwd, annotation=True)
    node = "autograd::engine::evaluate_function: "
    bwd_mul, bwd_t = op(node + "MulBackward0", seq=6), op(node + "TBackward0", seq=5)
    opt = op("eaglenest:optimizer", annotation=True)
    events = [
        fwd, norm, bwd_mul, bwd_t, opt,
        op("aten::mm", fwd, [("sm90_xmma_gemm_bf16", 100.0)], seq=5),
        op("aten::mul", norm, [("vectorized_elementwise_kernel", 10.0)], seq=6),
        op("aten::mul", bwd_mul, [("vectorized_elementwise_kernel", 20.0)]),
        op("aten::add_", bwd_t, [("vectorized_elementwise_kernel", 5.0)]),
        # the H200 records the host waiting on a full launch queue as a "kernel" of the op that waited: not GPU work
        op("aten::_fused_adamw_", opt, [("fused_adamw_kernel", 50.0), ("Command Buffer Full", 400.0)]),
        E(name="eaglenest:forward", device_type=DeviceType.CUDA, is_async=False, is_user_annotation=True,
          time_range=E(elapsed_us=lambda: 300.0)),
    ]
    res = step_profile.breakdown(events, steps=1, step_s=500e-6, cuda=True)
    ms = {c: v["ms"] for c, v in res["categories"].items()}
    assert ms == pytest.approx({"matmul": 0.1, "attention": 0.0, "softmax+CE": 0.0, "norms": 0.03,
                                "elementwise": 0.005, "optimizer": 0.05, "other": 0.0})
    assert res["backward_ms"]["norms"] == pytest.approx(0.02) and res["weight_grad_sums_ms"] == pytest.approx(0.005)
    assert res["idle_ms"] == pytest.approx(0.5 - 0.185)
    assert res["top_kernels"][0] == {"name": "sm90_xmma_gemm_bf16", "ms": pytest.approx(0.1), "calls": 1.0}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rmsnorm_candidate_is_the_drafters_rmsnorm(dtype: torch.dtype) -> None:
    from eaglenest.drafters.eagle3.norm import RMSNorm

    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.add_(0.3 * torch.randn(64))
    x = torch.randn(5, 7, 64).to(dtype)
    outs = []
    try:
        for kind in ("eager", "fused"):
            train_step.use_rmsnorm(kind)
            norm.weight.grad = None
            xi = x.clone().requires_grad_(True)
            y = norm(xi)
            (y.float() * torch.linspace(-1, 1, 64)).sum().backward()
            outs.append((y, xi.grad, norm.weight.grad))
    finally:
        train_step.use_rmsnorm("eager")
    assert RMSNorm.forward is train_step._EAGER_RMSNORM
    for a, b in zip(*outs, strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
