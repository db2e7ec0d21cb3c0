"""The packed small-batch CPU linear: exact enough, batch-independent, a drop-in for ``nn.Linear`` at inference.

The engine packs the target's linears by default on CPU fp32, so every spec-decoding test also runs on it; these
tests pin the kernel itself, the fallback to torch's linear, and greedy identity with the fallback too.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from eaglenest.kernels import PackedLinear, load_kernel, pack_linears, unavailable_reason, uses_packed_linears


@pytest.fixture(scope="module")
def kernel():
    lib = load_kernel()
    if lib is None:
        msg = f"CPU kernel unavailable: {unavailable_reason()}"
        if os.environ.get("CI"):  # CI installs a C compiler (.ci/run): there the kernel must build
            pytest.fail(msg)
        pytest.skip(msg)
    return lib


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 64])
@pytest.mark.parametrize(("n_out", "n_in"), [(48, 32), (37, 19), (1, 5), (300, 128), (40, 4096)])
def test_matches_torch_linear(kernel, rows, n_out, n_in):
    torch.manual_seed(rows * 1000 + n_out)
    lin = nn.Linear(n_in, n_out, bias=n_out % 2 == 1)
    x = torch.randn(rows, n_in)
    with torch.no_grad():
        want = lin(x)
        got = PackedLinear(lin)(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("n_in", "rows"), [(256, 11), (4096, 70)])  # 4096: rows run in tiles of 30
def test_row_result_does_not_depend_on_the_batch(kernel, n_in, rows):
    """Bitwise: row i alone == row i inside any batch, on 1 and 2 threads (greedy spec == plain greedy needs it)."""
    torch.manual_seed(0)
    packed = PackedLinear(nn.Linear(n_in, 320, bias=False))
    x = torch.randn(rows, n_in)
    threads = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2):
            torch.set_num_threads(t)
            with torch.no_grad():
                full = packed(x)
                outs.append(full)
                for i in range(x.shape[0]):
                    assert torch.equal(packed(x[i:i + 1]), full[i:i + 1]), f"row {i} differs alone ({t} threads)"
                assert torch.equal(packed(x[3:9]), full[3:9])
        assert torch.equal(outs[0], outs[1])
    finally:
        torch.set_num_threads(threads)


def test_keeps_leading_dims_and_weight_is_readable(kernel):
    lin = nn.Linear(24, 40)
    packed = PackedLinear(lin)
    assert torch.equal(packed.weight, lin.weight.detach())
    x = torch.randn(2, 3, 24)
    with torch.no_grad():
        torch.testing.assert_close(packed(x), lin(x), rtol=1e-5, atol=1e-5)
    assert packed(torch.randn(0, 24)).shape == (0, 40)


def test_refuses_what_it_cannot_do(kernel):
    packed = PackedLinear(nn.Linear(8, 8))
    with pytest.raises(RuntimeError, match="CPU float32 only"):
        packed(torch.randn(2, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="inference-only"):
        packed(torch.randn(2, 8, requires_grad=True))


def test_pack_linears_swaps_every_linear_and_can_copy(kernel):
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Sequential(nn.Linear(32, 8)))
    assert pack_linears(model, inplace=False)[1] == 0  # below MIN_PACKED_ELEMENTS: torch's linear is faster there
    copy, n = pack_linears(model, inplace=False, min_elements=0)
    assert n == 2 and uses_packed_linears(copy) and not uses_packed_linears(model)
    x = torch.randn(4, 16)
    with torch.no_grad():
        torch.testing.assert_close(copy(x), model(x), rtol=1e-5, atol=1e-5)
    assert pack_linears(nn.Linear(4, 4).to(torch.bfloat16), min_elements=0)[1] == 0  # not fp32: left to torch


def _greedy_identity(engine, prompts, drafts) -> None:
    """Speculative greedy == the engine's own greedy, chain and tree, batch 1 and 3."""
    from eaglenest.config import SpecConfig
    from eaglenest.engines.base import SamplingParams
    from eaglenest.speculative.decoder import SpecDecoder

    sampling = SamplingParams(max_new_tokens=24)
    want = [g.token_ids for g in engine.generate_ids(prompts, sampling)]
    for draft in drafts:
        for spec in (SpecConfig(num_steps=3, topk=1, num_draft_tokens=4), SpecConfig(num_steps=3, topk=2,
                                                                                     num_draft_tokens=6)):
            dec = SpecDecoder.from_engine(engine, draft, spec)
            for batch in (1, 3):
                got = [r.token_ids for i in range(0, len(prompts), batch)
                       for r in dec.generate(prompts[i:i + batch], sampling)]
                assert got == want, f"{type(draft).__name__} {spec} batch {batch}"


def test_engine_packs_big_linears_by_default_and_off_keeps_torch(kernel):
    from eaglenest.config import TargetConfig, TinyTargetSpec
    from eaglenest.engines.hf import HFEngine
    from eaglenest.engines.tiny import ensure_tiny_target
    from eaglenest.speculative.draft import TargetSelfDraft

    wide = ensure_tiny_target(TinyTargetSpec(hidden_size=512, num_heads=8, num_kv_heads=4, intermediate_size=1024,
                                             train_steps=0))
    packed = HFEngine.from_config(TargetConfig(model=str(wide), device="cpu", dtype="float32"))
    plain = HFEngine.from_config(TargetConfig(model=str(wide), device="cpu", dtype="float32", cpu_kernels="off"))
    kinds = {name.rsplit(".", 1)[-1]: type(m).__name__ for name, m in packed.model.named_modules()
             if isinstance(m, nn.Linear | PackedLinear)}
    assert set(kinds.values()) == {"PackedLinear"}, kinds  # every linear here has >= 2**17 weights
    assert not uses_packed_linears(plain.model)
    prompts = [plain.render_prompt([{"role": "user", "content": q}]) for q in ("count to five", "what is 3+4?",
                                                                                "say hi")]
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():  # same model either way: logits agree to fp32 rounding
        torch.testing.assert_close(packed.model(input_ids=ids).logits, plain.model(input_ids=ids).logits,
                                   rtol=1e-4, atol=1e-4)
    _greedy_identity(packed, prompts, [TargetSelfDraft(packed.model)])
    _greedy_identity(plain, prompts, [TargetSelfDraft(plain.model)])


def test_spec_greedy_identity_with_every_linear_packed(kernel, tiny_target_path, tiny_engine):
    """The tiny target's layers are below the packing threshold; packed anyway, speculation stays exact."""
    from eaglenest.config import TargetConfig
    from eaglenest.drafter.spec_fit import drafter_config_for
    from eaglenest.drafters.eagle3.model import Eagle3Drafter
    from eaglenest.engines.hf import HFEngine
    from eaglenest.speculative.draft import TargetSelfDraft

    engine = HFEngine.from_config(TargetConfig(model=str(tiny_target_path), device="cpu", dtype="float32"))
    _, n = pack_linears(engine.model, min_elements=0)
    assert n > 0 and not any(type(m) is nn.Linear for m in engine.model.modules())
    torch.manual_seed(0)
    drafter = Eagle3Drafter(drafter_config_for(engine, engine.aux_layer_ids, draft_vocab_size=400)).eval()
    prompts = [engine.render_prompt([{"role": "user", "content": q}]) for q in ("Count from 3 to 9.", "hello",
                                                                                 "What is 12 plus 5?")]
    _greedy_identity(engine, prompts, [TargetSelfDraft(engine.model), drafter])


def test_disabled_by_environment_falls_back_to_torch():
    code = ("from eaglenest.kernels import load_kernel, unavailable_reason; "
            "assert load_kernel() is None; print(unavailable_reason())")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "EAGLENEST_CPU_KERNELS": "0"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "EAGLENEST_CPU_KERNELS=0" in out.stdout
