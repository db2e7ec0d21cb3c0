"""What SGLang 0.5.14 accepts, checked before an engine starts (``eaglenest.engines.sglang.limits``).

The numbers are the H200 run's: a DeepseekV3 stand-in at Kimi-K2.5's widths (64 heads, kv_lora_rank 512) at context
2048 got 64 KV splits, and SGLang's triton MLA decode died with "an illegal memory access" at 1,860 running requests.
"""

from __future__ import annotations

import pytest

from eaglenest.config import SGLangEngineConfig
from eaglenest.contracts.target import TargetSpec
from eaglenest.engines.sglang.args import engine_kwargs
from eaglenest.engines.sglang.limits import (
    bound_running_requests,
    check_server_args,
    mla_triton_buffer_bytes,
    mla_triton_kv_splits,
    mla_triton_max_running_requests,
)

KIMI_STANDIN = TargetSpec(num_layers=61, hidden_size=7168, vocab_size=163840, architecture="DeepseekV3ForCausalLM",
                          context_length=2048, max_position_embeddings=2048, num_attention_heads=64,
                          kv_lora_rank=512)
LLAMA = TargetSpec(num_layers=32, hidden_size=4096, vocab_size=32000, architecture="LlamaForCausalLM",
                   context_length=2048, num_attention_heads=32, num_key_value_heads=8, head_dim=128)


def test_the_h200_crash_is_past_the_bound():
    splits = mla_triton_kv_splits(2048, sm_count=132)
    assert splits == 64  # max(8, min(next_pow2(132) = 256, next_pow2(2048 / 32) = 64))
    cap = mla_triton_max_running_requests(64, 512, splits)
    assert cap == 1023 < 1860
    assert 1023 * 64 * 64 * 512 < 2**31 <= 1024 * 64 * 64 * 512  # the kernel's int32 offset batch * stride


def test_kimi_at_tp8_and_its_real_context():
    splits = mla_triton_kv_splits(262144, sm_count=132)
    assert splits == 256
    assert mla_triton_max_running_requests(64 // 8, 512, splits) == 2047
    assert mla_triton_kv_splits(2048, sm_count=132, split_tile_size=256) == 8
    assert mla_triton_kv_splits(2048, sm_count=0) == 8 and mla_triton_kv_splits(64, sm_count=132) == 8


def test_engine_kwargs_bound_an_mla_target_on_triton():
    kw = engine_kwargs("m", SGLangEngineConfig(context_length=2048), target=KIMI_STANDIN)
    assert kw["max_running_requests"] <= 1023  # every current GPU's SM count gives at most this bound
    bounded = {"attention_backend": "triton", "context_length": 2048}
    bound_running_requests(bounded, KIMI_STANDIN, sm_count=132)
    assert bounded["max_running_requests"] == 1023
    lower = {"attention_backend": "triton", "context_length": 2048, "max_running_requests": 512}
    bound_running_requests(lower, KIMI_STANDIN, sm_count=132)
    assert lower["max_running_requests"] == 512  # a smaller setting is kept
    tp8 = {"attention_backend": "triton", "context_length": 2048, "tp_size": 8}
    bound_running_requests(tp8, KIMI_STANDIN, sm_count=132)
    assert tp8["max_running_requests"] == 8191  # 8 heads a rank


SMALL_STANDIN = TargetSpec(num_layers=32, hidden_size=4096, vocab_size=163840, architecture="DeepseekV3ForCausalLM",
                           context_length=2048, max_position_embeddings=2048, num_attention_heads=32,
                           kv_lora_rank=512)
"""the small preset (2026-12-06, an H100): 32 heads, kv_lora_rank 512, context 2048"""
GIB = 2**30


def test_the_h100_out_of_memory_is_past_the_memory_bound_and_the_h200_runs_are_within_it():
    """SGLang's triton MLA decode allocates its fp32 buffers every forward, outside its memory plan. The small
    preset's engines at the 32-bit cap (2,047 requests) asked for 7.99 GiB, their whole share of 19.8 GiB of non-static
    memory on an H100 at fraction 0.75, and died out of memory; at the same fraction on the H200 (34.8 GiB) the
    Kimi-width runs' 7.99 GiB ran. The memory bound lowers the first and leaves the second alone."""
    splits = mla_triton_kv_splits(2048, sm_count=132)
    assert 2047 * 32 * splits * 512 * 4 / GIB == pytest.approx(7.99, abs=0.01)  # attn_logits: the H100's failed ask
    assert 2047 * mla_triton_buffer_bytes(32, 512, splits) / GIB == pytest.approx(8.01, abs=0.01)  # with attn_lse
    h100 = {"attention_backend": "triton", "context_length": 2048, "mem_fraction_static": 0.75}
    bound_running_requests(h100, SMALL_STANDIN, sm_count=132, gpu_bytes=int(79.18 * GIB))
    assert 1000 < h100["max_running_requests"] < 1300
    assert h100["max_running_requests"] * mla_triton_buffer_bytes(32, 512, splits) <= 0.25 * 0.25 * 79.18 * GIB
    for target, kernel_cap in ((SMALL_STANDIN, 2047), (KIMI_STANDIN, 1023)):  # the H200: the kernel's cap binds
        h200 = {"attention_backend": "triton", "context_length": 2048, "mem_fraction_static": 0.75}
        bound_running_requests(h200, target, sm_count=132, gpu_bytes=int(139.8 * GIB))
        assert h200["max_running_requests"] == kernel_cap
    unknown = {"attention_backend": "triton", "context_length": 2048}  # no fraction: only the kernel's cap
    bound_running_requests(unknown, SMALL_STANDIN, sm_count=132, gpu_bytes=int(79.18 * GIB))
    assert unknown["max_running_requests"] == 2047


def test_an_explicit_setting_past_the_memory_bound_is_kept_with_a_warning(caplog: pytest.LogCaptureFixture):
    kw = {"attention_backend": "triton", "context_length": 2048, "mem_fraction_static": 0.75,
          "max_running_requests": 2000}
    with caplog.at_level("WARNING"):
        bound_running_requests(kw, SMALL_STANDIN, sm_count=132, gpu_bytes=int(79.18 * GIB))
    assert kw["max_running_requests"] == 2000
    assert "7.83 GiB a forward outside its memory plan" in caplog.text and "mem_fraction_static 0.75" in caplog.text


def test_a_larger_setting_is_refused_with_the_numbers_and_the_fix():
    with pytest.raises(ValueError) as e:
        engine_kwargs("m", SGLangEngineConfig(context_length=2048, max_running_requests=4096), target=KIMI_STANDIN)
    text = str(e.value)
    assert "4096" in text and "64 heads" in text and "kv_lora_rank 512" in text and "illegal memory access" in text
    assert "max_running_requests <=" in text and "triton_attention_split_tile_size" in text


def test_nothing_changes_without_mla_or_triton():
    assert "max_running_requests" not in engine_kwargs("m", SGLangEngineConfig(), target=LLAMA)
    fi = engine_kwargs("m", SGLangEngineConfig(attention_backend="flashinfer", context_length=2048),
                       target=KIMI_STANDIN)
    assert "max_running_requests" not in fi
    assert "max_running_requests" not in engine_kwargs("m", SGLangEngineConfig())  # no target: nothing known


def test_unknown_server_arguments_are_refused_with_the_closest_field():
    fields = {"cuda_graph_max_bs_decode", "cuda_graph_max_bs_prefill", "max_total_tokens", "model_path"}
    check_server_args({"model_path": "m", "max_total_tokens": 8}, fields, "0.5.14")
    with pytest.raises(ValueError) as e:
        check_server_args({"model_path": "m", "cuda_graph_max_bs": 32}, fields, "0.5.14")
    assert "cuda_graph_max_bs" in str(e.value) and "did you mean cuda_graph_max_bs_decode" in str(e.value)
    assert "target.sglang.extra_args" in str(e.value)


def test_a_speculative_launch_runs_as_many_requests_as_its_caller_asks() -> None:
    """SGLang caps an EAGLE launch without max_running_requests at 48: eaglenest always sets it"""
    from eaglenest.engines.sglang.limits import SGLANG_SPECULATIVE_RUNNING_REQUESTS, speculative_running_requests

    assert speculative_running_requests({}, 264) == {"max_running_requests": 264}
    assert speculative_running_requests({"max_running_requests": 32}, 264) == {}, "the config's own value stays"
    assert speculative_running_requests({"max_running_requests": None}, 8) == {"max_running_requests": 8}
    assert speculative_running_requests({}, None) == {"max_running_requests": SGLANG_SPECULATIVE_RUNNING_REQUESTS}
    with pytest.raises(ValueError, match="concurrency"):
        speculative_running_requests({}, 0)
