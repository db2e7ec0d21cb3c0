"""Contract tests of ``eaglenest.engines.sglang.limits`` against the real sglang 0.5.14 package (run by
.ci/sglang_contract.sh in its own venv; skipped elsewhere): the KV-split rule, the buffer and the 32-bit indexing
behind the running-request bound are SGLang's own, and every launch kwarg eaglenest and its GPU scripts build is a
``ServerArgs`` field (an unknown one failed an engine start on the H200 with a bare TypeError)."""

from __future__ import annotations

import inspect
import os
import sys
from pathlib import Path

import pytest

if os.environ.get("EAGLENEST_SGLANG_CONTRACT") != "1":
    pytest.skip("sglang contract tests run inside .ci/sglang_contract.sh's venv", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))  # sglang_shims
sys.path.insert(0, str(ROOT / "benchmarks"))
import sglang_shims  # noqa: E402

sglang_shims.install()

from sglang.srt.layers.attention import triton_backend  # noqa: E402
from sglang.srt.layers.attention.triton_ops import decode_attention  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402
from sglang_shims.fixtures import export_eagle3_drafter, write_target  # noqa: E402

from eaglenest.config import SGLangEngineConfig, SpecConfig  # noqa: E402
from eaglenest.contracts.layers import default_aux_layer_ids  # noqa: E402
from eaglenest.engines.sglang.args import capture_server_kwargs, engine_kwargs, generation_capture_kwargs  # noqa: E402
from eaglenest.engines.sglang.limits import (  # noqa: E402
    MLA_DECODE_MIN_BLOCK_KV,
    TRITON_KV_SPLITS,
    check_server_args,
    mla_triton_kv_splits,
)
from eaglenest.engines.sglang.spec import speculative_engine_kwargs  # noqa: E402
from eaglenest.engines.sglang.symbols import server_arg_fields  # noqa: E402


@pytest.mark.parametrize("sm", [0, 78, 108, 132, 148, 304])
@pytest.mark.parametrize("context", [64, 512, 2048, 4096, 32768, 262144])
def test_kv_splits_are_sglangs(sm: int, context: int) -> None:
    assert mla_triton_kv_splits(context, sm) == triton_backend._mla_decode_kv_splits_cap(TRITON_KV_SPLITS, sm,
                                                                                         context)


def test_the_buffer_and_its_32_bit_indexing() -> None:
    assert triton_backend._MLA_DECODE_MIN_BLOCK_KV == MLA_DECODE_MIN_BLOCK_KV
    assert ServerArgs.triton_attention_num_kv_splits == TRITON_KV_SPLITS
    backend = inspect.getsource(triton_backend.TritonAttnBackend)
    assert "(bs, self.num_head, self.max_kv_splits, self.v_head_dim)" in backend  # one fp32 partial per split
    # and one fp32 log-sum-exp per split: what mla_triton_buffer_bytes counts a request (allocated every forward)
    lse = "attn_lse = torch.empty(\n                (bs, self.num_head, self.max_kv_splits),\n"
    assert lse + "                dtype=torch.float32" in backend
    assert "self.max_kv_splits = _mla_decode_kv_splits_cap(" in backend
    stage2 = inspect.getsource(decode_attention._fwd_kernel_stage2)
    assert "cur_batch * stride_mid_ob" in stage2  # batch x (heads x splits x v_head_dim) in the kernel's int32


def test_every_launch_kwarg_is_a_server_arg(tmp_path: Path) -> None:
    import gpu_e2e
    import gpu_jit_warm

    fields = server_arg_fields()
    target = write_target(tmp_path / "target")
    drafter = export_eagle3_drafter(tmp_path / "drafter", physical_ids=default_aux_layer_ids(8))
    cfg = SGLangEngineConfig(max_running_requests=64, extra_args={
        **gpu_e2e.bench_engine_extra_args(), **gpu_e2e.SCHEDULER_LOG, **gpu_jit_warm.warm_extra_args(32)})
    built = [engine_kwargs(str(target), cfg), capture_server_kwargs(str(target), cfg),
             speculative_engine_kwargs(str(target), cfg, drafter, SpecConfig())[0],
             generation_capture_kwargs(engine_kwargs(str(target), cfg), [])]
    from eaglenest.config import TargetConfig
    from eaglenest.config.serving import ServeConfig
    from eaglenest.speculative.routed_engine import speculative_target

    routed = speculative_target(TargetConfig(model=str(target), engine="sglang", sglang=cfg),
                                ServeConfig(route={"by_load": True}), 4).sglang  # serve.route's second engine
    assert routed.mem_fraction_static == 0.9 and routed.extra_args["max_total_tokens"] == 8192
    built.append(speculative_engine_kwargs(str(target), routed, drafter, SpecConfig())[0])
    for kw in built:
        check_server_args(kw, fields, "0.5.14")
    assert built[-1]["max_total_tokens"] == 8192
    assert "cuda_graph_max_bs" not in fields  # a CLI alias only: as an Engine kwarg it is a TypeError
    with pytest.raises(ValueError, match="cuda_graph_max_bs_decode"):
        check_server_args({"cuda_graph_max_bs": 32}, fields, "0.5.14")
