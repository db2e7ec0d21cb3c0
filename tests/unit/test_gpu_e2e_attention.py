"""The GPU script's choice of the bench's attention backend: the warm-up tries it before any 44 GB engine depends on
it (triton for regen first, then the speculative engines, then the baseline), and a backend that failed there is
replaced by triton with the warm-up's error as the reason."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gpu_e2e = _module("gpu_e2e")
gpu_jit_warm = _module("gpu_jit_warm")


def test_the_warm_up_starts_regen_s_engine_first_then_the_speculative_ones_on_the_bench_s_backend() -> None:
    drafters = {"llama": Path("a"), "mla": Path("b")}
    assert gpu_jit_warm.warm_plan(drafters, "flashinfer") == [
        ("plain", "triton"), ("llama", "flashinfer"), ("mla", "flashinfer"), ("plain", "flashinfer")]
    assert gpu_jit_warm.warm_plan({"mla": Path("b")}, "triton") == [("plain", "triton"), ("mla", "triton")]


def test_the_warm_up_splits_into_regen_s_part_and_the_bench_s_part() -> None:
    """Phase A warms regen's engine beside pre-training; the bench's engines are warmed beside training, the bench's
    baseline always (its graph batch sizes are the bench's own, not regen's ladder)."""
    drafters = {"llama": Path("a"), "mla": Path("b")}
    assert gpu_jit_warm.warm_plan(drafters, "flashinfer", "regen") == [("plain", "triton")]
    assert gpu_jit_warm.warm_plan(drafters, "flashinfer", "bench") == [
        ("llama", "flashinfer"), ("mla", "flashinfer"), ("plain", "flashinfer")]
    assert gpu_jit_warm.warm_plan({"mla": Path("b")}, "triton", "bench") == [("mla", "triton"), ("plain", "triton")]
    with pytest.raises(ValueError, match="part"):
        gpu_jit_warm.warm_plan(drafters, "triton", "bnch")


def test_the_bench_s_engines_capture_graphs_at_its_batch_sizes_and_the_powers_of_two_below() -> None:
    assert gpu_e2e.graph_batch_sizes("1,8,32") == [1, 2, 4, 8, 16, 32]
    assert gpu_e2e.graph_batch_sizes("1,8") == [1, 2, 4, 8]
    assert gpu_e2e.graph_batch_sizes("3,24") == [1, 2, 3, 4, 8, 16, 24]
    assert gpu_jit_warm.warm_extra_args(32, [1, 2, 4])["cuda_graph_bs_decode"] == [1, 2, 4]
    assert "cuda_graph_bs_decode" not in gpu_jit_warm.warm_extra_args(32)  # regen's part: SGLang's ladder to 32


def test_a_backend_that_failed_in_the_bench_s_warm_up_beside_training_is_replaced_by_triton(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_e2e, "BENCH_ATTENTION", "flashinfer")
    monkeypatch.setattr(gpu_e2e, "gpu", lambda: True)
    reports = {"jit_wait": {"report": {"engines": [{"engine": "plain", "attention": "triton", "start_s": 60.0}]}},
               "jit_warm_bench": {"report": {"engines": [
                   {"engine": "llama", "attention": "flashinfer", "error": "RuntimeError: head size 112"}]}}}
    monkeypatch.setattr(gpu_e2e, "load", lambda name: reports.get(name, {}))
    backend, why = gpu_e2e.bench_attention()
    assert backend == "triton" and "llama engine: RuntimeError: head size 112" in why
    reports["jit_warm_bench"]["report"]["engines"] = [{"engine": "llama", "attention": "flashinfer", "start_s": 9.0}]
    assert gpu_e2e.bench_attention() == ("flashinfer", None)


def _warm_report(monkeypatch: pytest.MonkeyPatch, engines: list[dict]) -> None:
    monkeypatch.setattr(gpu_e2e, "BENCH_ATTENTION", "flashinfer")
    monkeypatch.setattr(gpu_e2e, "gpu", lambda: True)
    monkeypatch.setattr(gpu_e2e, "load", lambda name: {"report": {"engines": engines}} if name == "jit_wait" else {})


def test_a_backend_that_failed_in_the_warm_up_is_replaced_by_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    _warm_report(monkeypatch, [{"engine": "plain", "attention": "triton", "start_s": 60.0},
                               {"engine": "mla", "attention": "flashinfer", "error": "RuntimeError: no kernel"}])
    backend, why = gpu_e2e.bench_attention()
    assert backend == "triton"
    assert "flashinfer failed in the warm-up (mla engine: RuntimeError: no kernel)" in why


def test_an_engine_start_that_killed_the_warm_up_counts_as_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang ends its parent's process tree when a scheduler fails to start (the sixth Kimi-width run's Llama-shaped
    draft on flashinfer): the warm-up saves each engine as failed before starting it, so the report it leaves names
    that engine and the bench falls back to triton instead of calling flashinfer merely unverified."""
    _warm_report(monkeypatch, [{"engine": "plain", "attention": "triton", "start_s": 60.0},
                               {"engine": "llama", "attention": "flashinfer", "error": gpu_jit_warm.DIED_DURING_START}])
    backend, why = gpu_e2e.bench_attention()
    assert backend == "triton" and "llama engine: the warm-up process ended during this engine's start" in why


def test_an_engine_start_the_run_interrupted_at_its_deadline_is_not_a_failure(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The eighth Kimi-width run ended the warm-up (E2E_JIT_WAIT_S) ~115 s into the Llama-shaped draft's start on
    flashinfer: the record saved before that start is settled as interrupted, so flashinfer stays (unverified); the
    same record from a warm-up that ended on its own still counts as failed."""
    died = [{"engine": "plain", "attention": "triton", "start_s": 129.2},
            {"engine": "llama", "attention": "flashinfer", "error": gpu_jit_warm.DIED_DURING_START}]
    settled = gpu_jit_warm.settle_records(died, ended_by_deadline=True)
    assert settled[0] == died[0] and "error" not in settled[1] and settled[1]["interrupted"] == gpu_jit_warm.INTERRUPTED
    _warm_report(monkeypatch, settled)
    backend, why = gpu_e2e.bench_attention()
    assert backend == "flashinfer" and "unverified" in why
    assert gpu_jit_warm.settle_records(died, ended_by_deadline=False) == died
    _warm_report(monkeypatch, gpu_jit_warm.settle_records(died, ended_by_deadline=False))
    assert gpu_e2e.bench_attention()[0] == "triton"


def test_a_real_error_stays_an_error_even_when_the_deadline_ended_the_warm_up() -> None:
    rec = [{"engine": "mla", "attention": "flashinfer", "error": "RuntimeError: no kernel"}]
    assert gpu_jit_warm.settle_records(rec, ended_by_deadline=True) == rec
    oom = [{"engine": "mla", "attention": "flashinfer",
            "error": "RuntimeError: Rank 0 scheduler died during initialization (exit code: -9)."}]
    assert gpu_jit_warm.settle_records(oom, ended_by_deadline=True) == oom  # SIGKILL: maybe the OOM killer


def test_a_scheduler_the_deadline_s_sigterm_reached_first_is_interrupted_not_failed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The small-preset run (2026-12-06): the end of training sent SIGTERM to the bench's warm-up mid-start of the
    MLA engine; its scheduler died first and the warm-up itself recorded SGLang's error, so flashinfer was called
    failed and the bench ran on triton. Ended by the deadline, that record is an interruption."""
    died = [{"engine": "llama", "attention": "flashinfer", "start_s": 100.2},
            {"engine": "mla", "attention": "flashinfer", "error": "RuntimeError: Rank 0 scheduler died during "
             "initialization (exit code: -15). If exit code is -9 (SIGKILL), a common cause is the OS OOM killer."}]
    settled = gpu_jit_warm.settle_records(died, ended_by_deadline=True)
    assert "error" not in settled[1] and settled[1]["interrupted"] == gpu_jit_warm.INTERRUPTED
    _warm_report(monkeypatch, settled)
    assert gpu_e2e.bench_attention() == ("flashinfer", None)  # the llama engine ran on it
    assert gpu_jit_warm.settle_records(died, ended_by_deadline=False) == died  # it ended on its own: a failure


def test_a_backend_the_warm_up_ran_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    _warm_report(monkeypatch, [{"engine": "plain", "attention": "triton", "start_s": 60.0},
                               {"engine": "mla", "attention": "flashinfer", "start_s": 30.0}])
    assert gpu_e2e.bench_attention() == ("flashinfer", None)


def test_a_backend_the_warm_up_never_reached_is_kept_but_called_unverified(monkeypatch: pytest.MonkeyPatch) -> None:
    _warm_report(monkeypatch, [{"engine": "plain", "attention": "triton", "error": "killed"}])
    backend, why = gpu_e2e.bench_attention()
    assert backend == "flashinfer" and "unverified" in why


def test_the_bench_s_engines_build_no_prefill_graphs() -> None:
    assert gpu_e2e.bench_engine_extra_args()["disable_prefill_cuda_graph"] is True
    assert gpu_jit_warm.warm_extra_args(32)["disable_prefill_cuda_graph"] is True


def test_kimi_width_experts_follow_the_card(monkeypatch):
    """One command for either card: 4 routed experts where two 44 GB copies fit (H200), 2 on an 80 GB card; an
    explicit knob wins, and experts per token never exceed the routed ones."""
    for name in ("E2E_DS_ROUTED_EXPERTS", "E2E_DS_EXPERTS_PER_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(gpu_e2e, "DS_PRESET", "default")
    assert gpu_e2e.ds_experts(card=143_771 * 2**20) == (4, 4), "H200"
    assert gpu_e2e.ds_experts(card=81_559 * 2**20) == (2, 2), "H100 80GB HBM3, as nvidia-smi printed it"
    monkeypatch.setattr(gpu_e2e, "DS_PRESET", "small")
    assert gpu_e2e.ds_experts(card=81_559 * 2**20) == (4, 4), "the small preset is 13.3 GB on any card"
    monkeypatch.setattr(gpu_e2e, "DS_PRESET", "default")
    monkeypatch.setenv("E2E_DS_ROUTED_EXPERTS", "8")
    assert gpu_e2e.ds_experts(card=81_559 * 2**20) == (8, 4)
    monkeypatch.setenv("E2E_DS_EXPERTS_PER_TOKEN", "2")
    assert gpu_e2e.ds_experts(card=0) == (8, 2)
