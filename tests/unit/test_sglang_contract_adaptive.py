"""Contract tests of the adaptive launch eaglenest builds from a tuned schedule, parsed by sglang 0.5.14's own code
(run by .ci/sglang_contract.sh in its own venv; skipped elsewhere): ``ServerArgs`` accepts the kwargs and resolves
them as intended, SGLang's ``AdaptiveSpeculativeParams`` routes every batch size to the candidates the schedule
chose for it (with and without CUDA-graph padding), steps 0 is a valid start, the zero-step environment knob
exists, and eaglenest's refusal list is the one ``adaptive_unsupported_reason`` applies."""

from __future__ import annotations

import inspect
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

if os.environ.get("EAGLENEST_SGLANG_CONTRACT") != "1":
    pytest.skip("sglang contract tests run inside .ci/sglang_contract.sh's venv", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))  # sglang_shims
import sglang_shims  # noqa: E402

sglang_shims.install()

from sglang.srt import environ as sglang_environ  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402
from sglang.srt.speculative import adaptive_spec_params as asp  # noqa: E402
from sglang_shims.fixtures import export_eagle3_drafter, write_target  # noqa: E402

from eaglenest.config import SGLangEngineConfig, SpecConfig  # noqa: E402
from eaglenest.contracts.layers import default_aux_layer_ids  # noqa: E402
from eaglenest.engines.sglang.adaptive import (  # noqa: E402
    REFUSING_FLAGS,
    SKIP_ZERO_STEP_ENV,
    AdaptiveSpec,
    adaptive_kwargs,
    adaptive_refusal,
)
from eaglenest.engines.sglang.limits import (  # noqa: E402
    SGLANG_SPECULATIVE_RUNNING_REQUESTS,
    check_server_args,
    speculative_running_requests,
)
from eaglenest.engines.sglang.spec import speculative_engine_kwargs  # noqa: E402
from eaglenest.engines.sglang.symbols import server_arg_fields  # noqa: E402
from eaglenest.speculative.schedule import build_schedule  # noqa: E402

CPU_ONLY = {"device": "cuda", "skip_tokenizer_init": True}

# a schedule as tune writes it: spec wins at small batches, off from 64 on (measured at powers of two)
SPEC = AdaptiveSpec(((1, (3, 2)), (2, (3,)), (3, (2, 1)), (5, (1, 0)), (9, (0,)), (257, (0,))))


def _launch(tmp_path: Path, spec: AdaptiveSpec, concurrency: int | None = None) -> ServerArgs:
    target = write_target(tmp_path / "target")
    drafter = export_eagle3_drafter(tmp_path / "drafter", physical_ids=default_aux_layer_ids(8))
    top = max(1, max(spec.all_steps))
    kw, _ = speculative_engine_kwargs(str(target), SGLangEngineConfig(), drafter,
                                      SpecConfig(num_steps=top, topk=1, num_draft_tokens=top + 1))
    kw.update(adaptive_kwargs(spec, spec.write(tmp_path)))
    if concurrency is not None:
        kw.update(speculative_running_requests(kw, concurrency))
    check_server_args(kw, server_arg_fields(), "0.5.14")
    return ServerArgs(**kw, **CPU_ONLY)


def test_serverargs_resolves_the_adaptive_launch(tmp_path: Path) -> None:
    sa = _launch(tmp_path, SPEC)
    assert sa.speculative_adaptive is True, "SGLang turned adaptive mode off for eaglenest's launch"
    assert sa.speculative_algorithm == "EAGLE3"
    assert (sa.speculative_num_steps, sa.speculative_eagle_topk, sa.speculative_num_draft_tokens) == (3, 1, 4)
    assert sa.max_speculative_num_draft_tokens == max(SPEC.all_steps) + 1
    assert asp.resolve_candidate_steps_from_config(sa.speculative_adaptive_config) == SPEC.all_steps


def test_a_launch_pinned_to_off_is_valid(tmp_path: Path) -> None:
    """tune measures a speculative engine with drafting off as an adaptive engine whose only candidate is 0"""
    sa = _launch(tmp_path, AdaptiveSpec(((1, (0,)),)))
    assert sa.speculative_adaptive is True
    assert (sa.speculative_num_steps, sa.speculative_num_draft_tokens) == (0, 1)
    assert hasattr(sglang_environ.envs, SKIP_ZERO_STEP_ENV), "SGLang renamed its zero-step draft-extend knob"
    assert AdaptiveSpec(((1, (0,)),)).env == {SKIP_ZERO_STEP_ENV: "1"}


@pytest.mark.parametrize("cuda_graph_bs", [None, [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128,
                                                  160, 192, 224, 256]])
def test_sglang_routes_every_batch_size_to_the_schedules_candidates(tmp_path: Path, cuda_graph_bs) -> None:
    params = asp.AdaptiveSpeculativeParams(initial_steps=SPEC.initial_steps, cfg_path=str(SPEC.write(tmp_path)))
    params.set_cuda_graph_bs(cuda_graph_bs)
    for bs in range(1, 300):
        slot = params._route(bs)  # noqa: SLF001 - the routing rule is what we check
        assert slot.candidate_steps == sorted(SPEC.steps_for(bs)), bs
        if len(slot.candidate_steps) == 1:
            assert params.get_steps_for_batch(bs) == slot.candidate_steps[0]


def test_a_tuned_schedule_becomes_sglangs_config(tmp_path: Path) -> None:
    """build_schedule's chain candidates, as serve launches them, parsed and routed by SGLang"""
    def report(base: float, **tps: float) -> dict:
        return {"baseline": {"tok_per_s": base, "tok_per_s_rounds": [base, base * 1.005]},
                "configs": [{"config": k.replace("_", "-"), "tok_per_s": v, "tok_per_s_rounds": [v, v]}
                            for k, v in tps.items()]}

    per = {1: [report(100, off=99.8, **{"3_1_4": 190.0, "2_1_3": 170.0})],
           2: [report(180, off=179.9, **{"3_1_4": 250.0, "2_1_3": 240.0})],
           4: [report(300, off=299.0, **{"3_1_4": 280.0, "2_1_3": 310.0})]}
    spec = build_schedule(per, {}, noise_floor=0.01).adaptive_spec(provenance="test")
    params = asp.AdaptiveSpeculativeParams(initial_steps=spec.initial_steps, cfg_path=str(spec.write(tmp_path)))
    assert params.get_steps_for_batch(1) == 3 and params.get_steps_for_batch(2) == 3
    assert params.get_steps_for_batch(3) == 2 == params.get_steps_for_batch(4)
    assert params.get_steps_for_batch(5) == 0 == params.get_steps_for_batch(300), "unmeasured sizes run without drafts"


def test_our_refusals_are_sglangs() -> None:
    """every flag adaptive_unsupported_reason reads is in REFUSING_FLAGS, and both refuse the same launches"""
    src = inspect.getsource(asp.adaptive_unsupported_reason)
    read = set(re.findall(r"server_args\.(enable_\w+)", src))
    assert read == set(REFUSING_FLAGS), f"SGLang refuses on {sorted(read)}; eaglenest knows {sorted(REFUSING_FLAGS)}"

    def args(**kw) -> SimpleNamespace:
        base = {"speculative_algorithm": "EAGLE3", "speculative_eagle_topk": 1, **{f: False for f in REFUSING_FLAGS}}
        return SimpleNamespace(**{**base, **kw})

    assert asp.adaptive_unsupported_reason(args()) is None and adaptive_refusal({}, topk=1) is None
    assert asp.adaptive_unsupported_reason(args(speculative_eagle_topk=4)) and adaptive_refusal({}, topk=4)
    for flag in REFUSING_FLAGS:
        assert asp.adaptive_unsupported_reason(args(**{flag: True})), flag
        assert adaptive_refusal({flag: True}), flag


def test_sglang_caps_a_speculative_launch_unless_told(tmp_path: Path) -> None:
    """SGLang sets max_running_requests to 48 for an EAGLE launch without one (the plain engine gets 2,048+ from its
    KV pool); the concurrency eaglenest passes replaces it"""
    spec = AdaptiveSpec(((1, (3,)), (2, (0,))))
    assert _launch(tmp_path, spec).max_running_requests == SGLANG_SPECULATIVE_RUNNING_REQUESTS
    assert _launch(tmp_path, spec, concurrency=264).max_running_requests == 264
