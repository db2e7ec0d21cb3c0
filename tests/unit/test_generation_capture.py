"""Capture during generation without a GPU: the hooks of ``eaglenest.engines.sglang.hooks`` attached the way SGLang's
``forward_hooks`` attaches them (module names by fnmatch, the factory resolved from its import path), driven by a
CPU model with SGLang's Llama call convention through continuous-batching forwards (``tests/capture_toy.py``):
chunked prefill, mixed extend, decode steps with requests joining and leaving. The assembled states must equal a
plain teacher-forced forward of each final sequence, at every position training reads. (The contract venv runs the
same hooks through sglang's own ``register_forward_hooks``: tests/unit/test_sglang_contract.py.)
"""

from __future__ import annotations

import time

import pytest
import torch
from capture_toy import AUX, H, Model, Scheduler, V, attach

from eaglenest.contracts.states import unread_state_positions
from eaglenest.engines.base import CaptureHint
from eaglenest.engines.sglang.capture_sink import CaptureSinkError
from eaglenest.engines.sglang.hooks import ERROR_FILE, hook_specs
from eaglenest.engines.sglang.recorded import GenerationRecorder

ROW_BYTES = 4 * H * 4  # three aux streams and the final state, float32
SMALL_RING = 24 * ROW_BYTES
"""A ring that the toy's larger forwards (up to 16 rows) nearly fill: wrapping and waiting for the reader happen."""


def setup(tmp_path, writers: int = 3, ring_bytes: int = 0) -> tuple[Model, Scheduler, GenerationRecorder]:
    model = Model()
    rec = GenerationRecorder(str(tmp_path), AUX, hidden_size=H, dtype="float32", writers=writers,
                             ring_bytes=ring_bytes)
    attach(model, rec.hooks)
    rec.sink.start()
    return model, Scheduler(model), rec


@pytest.mark.parametrize("reserve,writers,ring_bytes",
                         [(False, 3, 0), (True, 3, 0), (True, 1, 0), (False, 1, SMALL_RING), (True, 1, SMALL_RING),
                          (True, 3, SMALL_RING), (True, 1, 1 << 20)],
                         ids=["placed-at-capture", "placed-on-arrival", "placed-on-arrival-one-writer",
                              "ring-placed-at-capture", "ring-placed-on-arrival", "ring-three-writers", "ring-roomy"])
def test_states_recorded_while_generating_equal_a_teacher_forced_forward(tmp_path, reserve: bool,
                                                                         writers: int, ring_bytes: int) -> None:
    model, sched, rec = setup(tmp_path, writers, ring_bytes)
    from eaglenest.engines.sglang.hooks import _RECORDERS

    assert len(_RECORDERS[str(rec.folder)].threads) == writers
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, V, (n,), generator=g).tolist() for n in (5, 9, 3, 12)]
    max_new = [4, 6, 1, 3]
    rids = rec.new_rids(len(prompts))
    if reserve:
        assert rec.reserve(rids, prompts, max(max_new))
    gens = sched.generate(prompts, max_new, rids)
    rec.expect(rids, prompts, gens)
    seqs = [p + gen.token_ids for p, gen in zip(prompts, gens, strict=True)]
    masks = [[0] * len(p) + [1] * len(gen.token_ids) for p, gen in zip(prompts, gens, strict=True)]
    hints = [CaptureHint(gen.meta["capture_ref"], m) for gen, m in zip(gens, masks, strict=True)]

    def no_prefill(seqs, rids):
        raise AssertionError("every sequence has its recordings")

    caps = rec.capture(seqs, hints, prefill=no_prefill)
    assert rec.counts == {"generation": 4}
    for seq, mask, cap in zip(seqs, masks, caps, strict=True):
        ref = model.model.reference(seq)
        got = torch.cat([cap.aux_hidden_states, cap.last_hidden_state], dim=-1)
        assert got.shape == (len(seq), 4 * H)
        unread = unread_state_positions(len(seq), mask)
        assert unread == {len(seq) - 1}  # the last answer token is never fed back
        read = [t for t in range(len(seq)) if t not in unread]
        torch.testing.assert_close(got[read], ref[read], rtol=1e-6, atol=1e-6)
        assert torch.count_nonzero(got[len(seq) - 1]) == 0
        # stored as they are: no reshuffling copy before the shard bytes
        assert cap.aux_hidden_states.is_contiguous() and cap.last_hidden_state.is_contiguous()
    assert rec.sink.rows(rids[0]) == 0  # the batch is consumed
    recorder = _RECORDERS[str(rec.folder)]
    if ring_bytes:  # every forward's states went through the ring, which the small one wrapped around
        assert recorder.ring is not None and recorder.ring_fallbacks == 0
        assert recorder.ring.produced > ring_bytes or ring_bytes > SMALL_RING
        assert not list(rec.folder.glob("*.chunk"))
    else:
        assert recorder.ring is None
    rec.close()


@pytest.mark.parametrize(("toy", "architecture"), [("deepseek", "DeepseekV3ForCausalLM"),
                                                   ("kimi", "KimiK25ForConditionalGeneration")])
def test_deepseek_and_kimi_layers_are_recorded_through_their_own_call_convention(tmp_path, toy: str,
                                                                                 architecture: str) -> None:
    """DeepseekV2's layers take 7 positional arguments and return (hidden, residual, topk_indices); Kimi keeps them
    under language_model. The hooks follow the architecture record, and the recorded streams equal a teacher-forced
    forward; the Llama record on the same model fails loudly (error file) instead of recording a wrong tensor."""
    model = Model(toy)
    rec = GenerationRecorder(str(tmp_path / "ok"), AUX, hidden_size=H, dtype="float32", writers=1,
                             architecture=architecture)
    attach(model, rec.hooks)
    rec.sink.start()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, V, (n,), generator=g).tolist() for n in (6, 11, 4)]
    rids = rec.new_rids(len(prompts))
    gens = Scheduler(model).generate(prompts, [3, 5, 2], rids)
    rec.expect(rids, prompts, gens)
    seqs = [p + gen.token_ids for p, gen in zip(prompts, gens, strict=True)]
    masks = [[0] * len(p) + [1] * len(gen.token_ids) for p, gen in zip(prompts, gens, strict=True)]
    hints = [CaptureHint(gen.meta["capture_ref"], m) for gen, m in zip(gens, masks, strict=True)]
    caps = rec.capture(seqs, hints, prefill=lambda s, r: (_ for _ in ()).throw(AssertionError("recorded")))
    for seq, cap in zip(seqs, caps, strict=True):
        got = torch.cat([cap.aux_hidden_states, cap.last_hidden_state], dim=-1)[:-1]
        torch.testing.assert_close(got, model.model.reference(seq)[:-1], rtol=1e-6, atol=1e-6)
    rec.close()
    if toy == "kimi":  # Llama's module paths do not exist in the Kimi wrapper: nothing would be hooked
        with pytest.raises(AssertionError):
            attach(Model(toy), hook_specs(tmp_path / "x", AUX))
        return
    llama = GenerationRecorder(str(tmp_path / "llama"), AUX, hidden_size=H, dtype="float32", writers=1)
    attach(model := Model(toy), llama.hooks)
    Scheduler(model).generate(prompts[:1], [2], llama.new_rids(1))
    assert "3-tuple" in (llama.folder / ERROR_FILE).read_text()
    llama.close()


@pytest.mark.parametrize("reserve", [False, True], ids=["placed-at-capture", "placed-on-arrival"])
def test_cut_back_and_mismatched_sequences_fall_back_to_a_recorded_prefill(tmp_path, reserve: bool) -> None:
    model, sched, rec = setup(tmp_path)
    prompts = [[3, 4, 5, 6, 7, 8], [9, 10, 11, 12]]
    rids = rec.new_rids(2)
    if reserve:
        assert rec.reserve(rids, prompts, 5)
    gens = sched.generate(prompts, [5, 5], rids)
    rec.expect(rids, prompts, gens)
    # sample 0 was cut back to its prompt's first 5 tokens (an earlier turn boundary): rows past the end are ignored
    cut = prompts[0][:5]
    # sample 1 ends in an appended end-of-turn token that the engine never generated (masked out: a truncated answer)
    truncated = prompts[1] + gens[1].token_ids + [49]
    # sample 2: the hint points at request 0 but the sequence differs from what it computed -> recorded prefill
    other = [3, 4, 20, 21, 22]
    masks = [[0, 0, 0, 1, 1], [0] * 4 + [1] * 5 + [0], [0, 0, 1, 1, 1]]
    hints = [CaptureHint(rids[0], masks[0]), CaptureHint(rids[1], masks[1]), CaptureHint(rids[0], masks[2])]
    calls = []

    def prefill(seqs, new_rids):
        calls.append(seqs)
        sched.generate(seqs, [1] * len(seqs), new_rids)

    caps = rec.capture([cut, truncated, other], hints, prefill=prefill)
    assert calls == [[other]]
    assert rec.counts == {"generation": 2, "prefill": 1}
    assert "computed token 5 at position 2" in rec.fallback_reasons[-1]
    for seq, mask, cap in zip([cut, truncated, other], masks, caps, strict=True):
        ref = model.model.reference(seq)
        got = torch.cat([cap.aux_hidden_states, cap.last_hidden_state], dim=-1)
        read = [t for t in range(len(seq)) if t not in unread_state_positions(len(seq), mask)]
        torch.testing.assert_close(got[read], ref[read], rtol=1e-6, atol=1e-6)
    assert unread_state_positions(len(truncated), masks[1]) == {len(truncated) - 2, len(truncated) - 1}
    rec.close()


@pytest.mark.parametrize("reserve", [False, True], ids=["placed-at-capture", "placed-on-arrival"])
def test_missing_rows_that_training_reads_are_refused(tmp_path, reserve: bool) -> None:
    model, sched, rec = setup(tmp_path)
    prompts = [[3, 4, 5, 6]]
    rids = rec.new_rids(1)
    if reserve:
        assert rec.reserve(rids, prompts, 2)
    gens = sched.generate(prompts, [2], rids)
    rec.expect(rids, prompts, gens)
    seq = prompts[0] + gens[0].token_ids + [7]  # one token the engine never saw, masked in: its teacher is read
    rec.sink.wait({rids[0]: 5})
    cap, why = rec.sink.assemble(rids[0], seq, [0, 0, 0, 0, 1, 1, 1])
    assert cap is None and "no states for 1 positions training reads (first 5)" in why
    rec.close()


def test_a_recorder_failure_is_reported(tmp_path) -> None:
    model, sched, rec = setup(tmp_path)
    (rec.folder / ERROR_FILE).write_text("final hook\nTraceback: boom")
    with pytest.raises(CaptureSinkError, match="boom"):
        rec.sink.wait({"x": 1})
    rec.close()


def test_layer_zero_is_refused() -> None:
    with pytest.raises(ValueError, match="physical aux ids >= 1"):
        hook_specs("/tmp/x", [0, 3, 5])


def test_specs_name_the_modules_sglang_llama_has() -> None:
    specs = hook_specs("/tmp/x", [2, 16, 29])
    assert [s["target_modules"] for s in specs] == [["model.layers.1"], ["model.layers.15"], ["model.layers.28"],
                                                    ["model.norm"]]
    assert all(s["hook_factory"] == "eaglenest.engines.sglang.hooks:capture_hook" for s in specs)


def test_generation_capture_launch_kwargs_and_guards() -> None:
    from eaglenest.config import SGLangEngineConfig
    from eaglenest.engines.sglang.args import check_generation_capture, engine_kwargs, generation_capture_kwargs

    hooks = hook_specs("/tmp/x", [2, 4, 5])
    assert {h["config"]["writers"] for h in hooks} == {SGLangEngineConfig().capture_writers} == {1}
    assert {h["config"]["writers"] for h in hook_specs("/tmp/x", [2, 4, 5], writers=3)} == {3}
    assert {h["config"]["ring"] for h in hooks} == {False}  # the engine asks for the ring (4 GiB by default)
    assert SGLangEngineConfig().capture_ring_gib == 4
    assert {h["config"]["ring"] for h in hook_specs("/tmp/x", [2, 4, 5], ring=True)} == {True}
    with pytest.raises(ValueError, match="capture_writers"):
        SGLangEngineConfig(capture_writers=0)
    kw = generation_capture_kwargs(engine_kwargs("m", SGLangEngineConfig()), hooks)
    assert kw["forward_hooks"] == hooks and kw["disable_radix_cache"] is True and kw["disable_cuda_graph"] is True
    with pytest.raises(ValueError, match="speculative"):
        generation_capture_kwargs({"speculative_algorithm": "EAGLE3"}, hooks)
    with pytest.raises(ValueError, match="forward_hooks"):  # users cannot smuggle their own hooks past it
        engine_kwargs("m", SGLangEngineConfig(extra_args={"forward_hooks": []}))
    check_generation_capture("LlamaForCausalLM", 1)
    check_generation_capture("DeepseekV3ForCausalLM", 1)  # verified on the H200 (BENCHMARKS.md)
    check_generation_capture("KimiK25ForConditionalGeneration", 1)
    with pytest.raises(ValueError, match="GlmMoeDsaForCausalLM: use target.sglang.capture: prefill"):
        check_generation_capture("GlmMoeDsaForCausalLM", 1)
    with pytest.raises(ValueError, match="tp_size 1 only"):
        check_generation_capture("LlamaForCausalLM", 8)


def test_run_generate_names_requests_and_keeps_completion_counts() -> None:
    from eaglenest.engines.base import SamplingParams
    from eaglenest.engines.sglang.args import run_generate

    seen = {}

    def generate(**kw):
        seen.update(kw)
        return [{"output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "length"}, "completion_tokens": 2,
                                                     "prompt_tokens": 3}}]

    gens = run_generate(generate, [[1, 2, 3]], SamplingParams(max_new_tokens=2), decode=str, rids=["r0"])
    assert seen["rid"] == ["r0"] and gens[0].meta["completion_tokens"] == 2
    seen.clear()
    run_generate(generate, [[1, 2, 3]], SamplingParams(max_new_tokens=2), decode=str)
    assert "rid" not in seen  # without rids, sglang names requests itself, as before


@pytest.mark.parametrize("reserve,ring_bytes", [(False, 0), (True, 0), (False, SMALL_RING), (True, SMALL_RING)],
                         ids=["placed-at-capture", "placed-on-arrival", "ring-placed-at-capture",
                              "ring-placed-on-arrival"])
def test_two_batches_in_flight_keep_each_others_rows(tmp_path, reserve: bool, ring_bytes: int) -> None:
    """regen.batches_in_flight = 2: two threads (one per batch, as Ray Data runs an actor call) each generate a batch
    of two turns, then capture; a capture drops only its own thread's requests (earlier turns included), so the other
    batch still assembles, and nothing is left once both are done. With a small ring, rows kept for later must leave
    it before their space is reused."""
    import threading

    model, sched, rec = setup(tmp_path, ring_bytes=ring_bytes)
    batches = {"a": [[3, 4, 5, 6, 7], [8, 9, 10]], "b": [[11, 12, 13, 14], [15, 16, 17, 18, 19, 20]]}
    go = {k: threading.Event() for k in ("a-gen", "b-gen", "a-cap", "b-cap")}
    done = {k: threading.Event() for k in go}
    state: dict = {}

    def worker(name: str) -> None:
        go[f"{name}-gen"].wait()
        prompts = batches[name]
        sched.generate(prompts, [2, 2], rec.new_rids(2))  # an earlier turn, superseded below
        rids = rec.new_rids(2)
        if reserve:
            assert rec.reserve(rids, prompts, 4)
        gens = sched.generate(prompts, [3, 4], rids)
        rec.expect(rids, prompts, gens)
        done[f"{name}-gen"].set()
        go[f"{name}-cap"].wait()
        seqs = [p + g.token_ids for p, g in zip(prompts, gens, strict=True)]
        hints = [CaptureHint(g.meta["capture_ref"], [0] * len(p) + [1] * len(g.token_ids))
                 for p, g in zip(prompts, gens, strict=True)]
        state[name] = (rids, seqs, rec.capture(seqs, hints, prefill=lambda s, r: pytest.fail("no prefill")))
        done[f"{name}-cap"].set()

    # daemon: a failed assertion below must not leave the process waiting on a worker that waits for its go
    threads = [threading.Thread(target=worker, args=(n,), daemon=True) for n in ("a", "b")]
    for t in threads:
        t.start()
    for step in ("a-gen", "b-gen", "a-cap"):
        go[step].set()
        assert done[step].wait(30)
    b_rids = state.get("b", (None,))[0] or []
    assert not b_rids  # b has not captured yet
    deadline = time.monotonic() + 30  # b's rows leave its writer threads asynchronously: read until they are all in
    while True:
        rec.sink.poll()
        with rec.sink._lock:
            live = set(rec.sink._index) | set(rec.sink._slots)
        if len(live) >= 4 or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert len(live) == 4 and all(r.startswith("eaglenest-") for r in live)  # b's two turns, two requests each
    go["b-cap"].set()
    assert done["b-cap"].wait(30)
    for t in threads:
        t.join()
    for name in ("a", "b"):
        _, seqs, caps = state[name]
        for seq, cap in zip(seqs, caps, strict=True):
            got = torch.cat([cap.aux_hidden_states, cap.last_hidden_state], dim=-1)
            torch.testing.assert_close(got[:-1], model.model.reference(seq)[:-1], rtol=1e-6, atol=1e-6)
    rec.sink.poll()
    with rec.sink._lock:  # every row of both batches released
        assert not rec.sink._chunks and not rec.sink._index and not rec.sink._slots
        assert rec.sink._reserved_bytes == 0
    rec.close()


def test_rows_arriving_after_their_request_was_released_are_not_kept(tmp_path) -> None:
    """A wait that ends on its quiet timeout can leave chunks unread; when they arrive after the request's batch was
    released, nothing of them is kept (no memory grows for the rest of the run)."""
    import torch as t

    from eaglenest.engines.sglang.capture_sink import CaptureSink
    from eaglenest.engines.sglang.hooks import write_chunk

    sink = CaptureSink(tmp_path, hidden_size=2, n_aux=1)
    rows = lambda n: (t.arange(n, dtype=t.int32), t.arange(n, dtype=t.int32), t.ones(n, 4))  # noqa: E731
    write_chunk(tmp_path, 0, ["r1", "r2"], [2, 1], *rows(3))
    sink.poll()
    sink.discard(["r1"])
    write_chunk(tmp_path, 1, ["r1"], [1], *rows(1))  # late: r1 was released
    write_chunk(tmp_path, 2, ["r1", "r2"], [1, 1], *rows(2))
    assert sink.poll() == 2
    assert sink.rows("r1") == 0 and sink.rows("r2") == 2
    with sink._lock:
        assert len(sink._chunks) == 2 and "r1" not in sink._index  # chunk 1 (r1 alone) was never kept
    sink.discard(["r2"])
    with sink._lock:
        assert not sink._chunks
    sink.close()



def test_a_warm_up_generating_beside_a_batch_leaves_no_rows_and_the_batch_whole(tmp_path) -> None:
    """Regen's engine warm-up (throw-away request ids, released up front) sharing forwards with a real batch: none of
    its rows is kept, none is owned by the calling thread, and the batch's states are still the teacher-forced ones.
    Control: the same warm-up requests under ordinary ids would have left their rows in the sink."""
    model, sched, rec = setup(tmp_path, writers=1)
    g = torch.Generator().manual_seed(3)
    warm_prompts = [torch.randint(1, V, (n,), generator=g).tolist() for n in (4, 6)]
    prompts = [torch.randint(1, V, (n,), generator=g).tolist() for n in (5, 7)]
    warm = rec.throwaway_rids(len(warm_prompts))
    rids = rec.new_rids(len(prompts))
    gens = sched.generate(warm_prompts + prompts, [3, 3, 4, 2], warm + rids)[len(warm):]
    rec.expect(rids, prompts, gens)
    seqs = [p + gen.token_ids for p, gen in zip(prompts, gens, strict=True)]
    masks = [[0] * len(p) + [1] * len(gen.token_ids) for p, gen in zip(prompts, gens, strict=True)]
    hints = [CaptureHint(gen.meta["capture_ref"], m) for gen, m in zip(gens, masks, strict=True)]
    caps = rec.capture(seqs, hints, prefill=lambda s, r: pytest.fail("every sequence has its recordings"))
    for seq, cap in zip(seqs, caps, strict=True):
        got = torch.cat([cap.aux_hidden_states, cap.last_hidden_state], dim=-1)[:-1]
        torch.testing.assert_close(got, model.model.reference(seq)[:-1], rtol=1e-6, atol=1e-6)
    assert all(rec.sink.rows(r) == 0 for r in warm)
    assert not rec._owned  # the warm-up's ids were never the thread's to release
    # control: ordinary ids for the same requests keep their rows until a capture consumes them
    kept = rec.new_rids(len(warm_prompts))
    sched.generate(warm_prompts, [3, 3], kept)
    deadline = time.monotonic() + 10
    while rec.sink.rows(kept[0]) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rec.sink.rows(kept[0]) > 0
    rec.close()


def test_chunks_written_out_of_order_are_read_in_forward_order(tmp_path) -> None:
    """The hooks write chunks from several threads, so forward k + 1's file can land before forward k's. The reader
    takes them in forward order: it waits for k, and where a position was recorded twice (a retracted, recomputed
    request) the later forward's row wins."""
    import torch as t

    from eaglenest.engines.sglang.capture_sink import CaptureSink
    from eaglenest.engines.sglang.hooks import write_chunk

    sink = CaptureSink(tmp_path, hidden_size=2, n_aux=1)
    assert sink.reserve(["r"], [4])
    pos = t.tensor([2], dtype=t.int32)
    write_chunk(tmp_path, 1, ["r"], [1], t.tensor([9], dtype=t.int32), pos, t.full((1, 4), 2.0))  # the recompute
    assert sink.poll() == 0  # forward 0 has not landed yet
    write_chunk(tmp_path, 0, ["r"], [3], t.tensor([5, 6, 7], dtype=t.int32), t.arange(3, dtype=t.int32),
                t.ones(3, 4))
    assert sink.poll() == 2
    cap, why = sink.assemble("r", [5, 6, 9, 8], [0, 1, 1, 1])
    assert why == "" and cap is not None
    assert cap.aux_hidden_states[:3, 0].tolist() == [1.0, 1.0, 2.0]
    sink.close()


def test_reserving_and_checking_do_not_wait_for_rows_being_copied(tmp_path) -> None:
    """The reader copies rows into slabs outside the lock that ``reserve``/``wait``/``assemble`` take: a batch about
    to be submitted must not wait behind other batches' copies (the sixth GPU run: half the batches waited ~0.7 s to
    reserve while the first prompts' prefill chunks were placed). Rows count as arrived only once copied."""
    import threading

    import torch as t

    from eaglenest.engines.sglang.capture_sink import CaptureSink
    from eaglenest.engines.sglang.hooks import write_chunk

    sink = CaptureSink(tmp_path, hidden_size=2, n_aux=1)
    assert sink.reserve(["a"], [4])
    copying, release = threading.Event(), threading.Event()
    place = sink._place

    def slow_place(*args):  # the real copy, held open until the test lets it finish
        copying.set()
        release.wait(10)
        return place(*args)

    sink._place = slow_place
    write_chunk(tmp_path, 0, ["a"], [3], t.tensor([5, 6, 7], dtype=t.int32), t.arange(3, dtype=t.int32), t.ones(3, 4))
    reader = threading.Thread(target=sink.poll)
    reader.start()
    assert copying.wait(10)
    t0 = time.monotonic()
    assert sink.reserve(["b"], [4])  # another batch reserves while "a"'s rows are being copied
    assert sink.poll(block=False) == 0  # a waiting batch does not queue behind the reader either
    assert sink.rows("a") == 0  # not arrived until copied
    assert time.monotonic() - t0 < 1.0
    release.set()
    reader.join(10)
    assert sink.rows("a") == 3
    cap, why = sink.assemble("a", [5, 6, 7, 8], [0, 1, 1, 1])
    assert why == "" and cap is not None and cap.aux_hidden_states[:3].eq(1).all()
    sink.close()


def test_the_reader_reports_what_it_read_since_it_was_last_asked(tmp_path) -> None:
    """Each regen batch logs how long it waited for its last rows and what the reader did meanwhile: chunks, bytes,
    time spent reading and placing, and how old each chunk file was when read (behind the writer, or slow)."""
    import os

    import torch as t

    from eaglenest.engines.sglang.capture_sink import CaptureSink
    from eaglenest.engines.sglang.hooks import chunk_name, write_chunk

    sink = CaptureSink(tmp_path, hidden_size=2, n_aux=1)
    assert sink.take_stats().line() == "reader: no chunk since the last batch"
    rows = lambda n: (t.arange(n, dtype=t.int32), t.arange(n, dtype=t.int32), t.ones(n, 4))  # noqa: E731
    write_chunk(tmp_path, 0, ["r1"], [3], *rows(3))
    write_chunk(tmp_path, 1, ["r1"], [1], *rows(1), forward_at=time.time() - 7)  # its forward ran 7 s ago ...
    sizes = sum((tmp_path / chunk_name(k)).stat().st_size for k in (0, 1))
    os.utime(tmp_path / chunk_name(1), (time.time() - 5, time.time() - 5))  # ... it was written 5 s ago
    assert sink.poll() == 2
    st = sink.take_stats()
    assert st.chunks == 2 and st.bytes == sizes and 5 <= st.lag_max_s < 60 and st.placing_s >= 0
    assert st.write_lag_n == 1 and 1.5 < st.write_lag_max_s < 2.5  # the writer's share: 2 s of the 7
    assert "2 chunks" in st.line() and "max 5." in st.line() and "written after their forward" in st.line()
    assert sink.take_stats().chunks == 0  # started afresh
    # the hooks say what recording has cost the scheduler so far; the latest word stays, even for a batch that read
    # no chunk of its own
    write_chunk(tmp_path, 2, ["r1"], [1], *rows(1), scheduler={"hooks_s": 1.25, "blocked_s": 0.5, "pinning_s": 0.125})
    assert sink.poll() == 1
    sink.take_stats()
    line = sink.take_stats().line()
    assert line.startswith("reader: no chunk since the last batch") and "1.25 s in the hooks" in line
    assert "0.50 s of it waiting for a writer or the ring" in line and "pinning memory 0.12 s" in line
    sink.close()


def test_every_chunk_says_what_recording_has_cost_the_scheduler(tmp_path) -> None:
    """The hooks time themselves on the forward thread (and any wait for a writer), so a slow generation pace can be
    told apart from recording's cost; the sums only grow."""
    from eaglenest.engines.sglang.hooks import _RECORDERS

    model, sched, rec = setup(tmp_path)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    rids = rec.new_rids(2)
    rec.expect(rids, prompts, sched.generate(prompts, [4, 4], rids))
    recorder = _RECORDERS[str(rec.folder)]
    deadline = time.time() + 30
    while (said := rec.sink.take_stats().scheduler) is None and time.time() < deadline:
        time.sleep(0.05)
    costs = recorder.costs()
    assert {"hooks_s", "blocked_s", "pinning_s"} <= set(costs) and costs["hooks_s"] > 0
    # the scheduler thread's decode steps, timed from the hooks: launching the layers, and the time between steps
    assert costs["decode_steps"] >= 2 and costs["decode_launch_ms"] > 0 and costs["decode_between_ms"] >= 0
    assert "decode steps on the scheduler's thread" in rec.sink.take_stats().line()
    assert said is not None and 0 < said["hooks_s"] <= costs["hooks_s"]
    assert costs["blocked_s"] <= costs["hooks_s"] and costs["pinning_s"] == 0  # no CUDA here: nothing pinned
    # each writer's pinned staging is sized at start for a prefill chunk of SGLang's 8192 rows: a power of two
    need = 8192 * (H * (len(AUX) + 1) * 4 + 8)
    assert {h["config"]["staging_bytes"] for h in rec.hooks} == {1 << (need - 1).bit_length()}
    rec.close()

def _truncated_batch(rec: GenerationRecorder, sched: Scheduler, prompts: list[list[int]], max_new: int, *,
                     reserve: bool = True) -> tuple[list[str], list[list[int]], list[CaptureHint]]:
    """A batch whose answers all hit ``max_new`` and are closed by an appended end-of-turn token (as regen closes a
    truncated turn): each sequence is prompt + max_new + 1 tokens, the whole reservation."""
    rids = rec.new_rids(len(prompts))
    if reserve:
        assert rec.reserve(rids, prompts, max_new)
    gens = sched.generate(prompts, [max_new] * len(prompts), rids)
    rec.expect(rids, prompts, gens)
    seqs = [p + g.token_ids + [V - 1] for p, g in zip(prompts, gens, strict=True)]
    hints = [CaptureHint(g.meta["capture_ref"], [0] * len(p) + [1] * max_new + [0])
             for p, g in zip(prompts, gens, strict=True)]
    return rids, seqs, hints


def test_reserved_rows_are_placed_while_generating_and_their_chunks_freed(tmp_path) -> None:
    """Reserved requests' rows are copied into place as their chunks arrive: nothing of the batch waits in chunk files
    or kept chunks by the time it is captured, and the captures are consecutive slices of one piece of memory (so the
    Arrow column takes it without a copy)."""
    from eaglenest.contracts.shards import tensor_to_buffer
    from eaglenest.regen.stage import blob_column

    model, sched, rec = setup(tmp_path)
    prompts = [[3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14]]
    rids, seqs, hints = _truncated_batch(rec, sched, prompts, 4)
    rec.sink.wait({r: len(p) + 3 for r, p in zip(rids, prompts, strict=True)})
    with rec.sink._lock:
        assert not rec.sink._chunks  # no chunk kept for later placement
        slab = rec.sink._slots[rids[0]][0]
        assert int((slab.ids >= 0).sum()) == sum(len(p) + 3 for p in prompts)  # every recorded row in place
    assert not list(rec.folder.glob("*.chunk"))
    caps = rec.capture(seqs, hints, prefill=lambda s, r: pytest.fail("no prefill"))
    assert rec.counts == {"generation": 3} and rec.sink.served == {"on_arrival": 3}
    for seq, cap in zip(seqs, caps, strict=True):
        got = torch.cat([cap.aux_hidden_states, cap.last_hidden_state], dim=-1)
        torch.testing.assert_close(got[:-2], model.model.reference(seq)[:-2], rtol=1e-6, atol=1e-6)
        assert torch.count_nonzero(got[-2:]) == 0  # never fed back: nothing recorded, zeroed
    col = blob_column([tensor_to_buffer(c.aux_hidden_states, "float32") for c in caps])
    assert col.buffers()[2].address == caps[0].aux_hidden_states.data_ptr()  # zero copy
    rec.close()


def test_reused_memory_never_leaks_an_earlier_batch_into_unrecorded_positions(tmp_path) -> None:
    model, sched, rec = setup(tmp_path)
    prompts = [[3, 4, 5, 6, 7], [8, 9, 10]]
    first = rec.capture(*_truncated_batch(rec, sched, prompts, 4)[1:], prefill=lambda s, r: pytest.fail("no"))
    for c in first:
        c.aux_hidden_states.fill_(7.0)  # the earlier batch's memory, dirty
        c.last_hidden_state.fill_(7.0)
    del first, c
    _, seqs, hints = _truncated_batch(rec, sched, prompts, 4)
    assert rec.sink.buffers.reused >= 2  # the same memory again
    for seq, cap in zip(seqs, rec.capture(seqs, hints, prefill=lambda s, r: pytest.fail("no")), strict=True):
        got = torch.cat([cap.aux_hidden_states, cap.last_hidden_state], dim=-1)
        assert torch.count_nonzero(got[-2:]) == 0
        torch.testing.assert_close(got[:-2], model.model.reference(seq)[:-2], rtol=1e-6, atol=1e-6)
    rec.close()


def test_rows_past_a_reservation_fall_back_to_a_recorded_prefill(tmp_path) -> None:
    model, sched, rec = setup(tmp_path)
    prompts = [[3, 4, 5, 6, 7]]
    rids = rec.new_rids(1)
    assert rec.sink.reserve(rids, [4])  # too small: the prompt alone has 5 positions
    gens = sched.generate(prompts, [3], rids)
    rec.expect(rids, prompts, gens)
    seq = prompts[0] + gens[0].token_ids
    calls = []

    def prefill(seqs, new_rids):
        calls.append(seqs)
        sched.generate(seqs, [1] * len(seqs), new_rids)

    (cap,) = rec.capture([seq], [CaptureHint(rids[0], [0] * 5 + [1] * 3)], prefill=prefill)
    assert calls == [[seq]] and rec.counts == {"prefill": 1}
    assert "past the 4 reserved" in rec.fallback_reasons[-1]
    got = torch.cat([cap.aux_hidden_states, cap.last_hidden_state], dim=-1)
    torch.testing.assert_close(got[:-1], model.model.reference(seq)[:-1], rtol=1e-6, atol=1e-6)
    rec.close()


def test_a_batch_beyond_the_reservation_budget_is_placed_at_capture(tmp_path) -> None:
    model, sched, rec = setup(tmp_path)
    rec.sink.reserve_max_bytes = 10 * 4 * H * 4  # room for 10 rows of float32 states
    assert rec.sink.reserve(["a"], [8])
    assert not rec.sink.reserve(["b"], [8])  # 16 rows in flight would exceed it
    rec.sink.discard(["a"])
    assert rec.sink.reserve(["c"], [8])  # a's room is free again
    rec.sink.discard(["c"])
    prompts = [[3, 4, 5, 6, 7], [8, 9, 10]]
    rids, seqs, hints = _truncated_batch(rec, sched, prompts, 4, reserve=False)
    assert not rec.reserve(rids, prompts, 4)  # 2 x 10 rows: over the budget, so the chunks are kept instead
    for seq, cap in zip(seqs, rec.capture(seqs, hints, prefill=lambda s, r: pytest.fail("no")), strict=True):
        got = torch.cat([cap.aux_hidden_states, cap.last_hidden_state], dim=-1)
        torch.testing.assert_close(got[:-2], model.model.reference(seq)[:-2], rtol=1e-6, atol=1e-6)
    assert rec.sink.served == {"at_capture": 2}
    rec.close()


def test_a_reader_failure_is_reported_not_waited_out(tmp_path) -> None:
    import time

    from eaglenest.engines.sglang.capture_sink import CaptureSink
    from eaglenest.engines.sglang.hooks import chunk_name

    sink = CaptureSink(tmp_path, hidden_size=2, n_aux=1, poll_s=0.01)
    sink.start()
    (tmp_path / chunk_name(0)).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a json header")
    deadline = time.monotonic() + 10
    while sink._thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(CaptureSinkError, match="reading the recorded states failed in the engine actor"):
        sink.check()
    sink.close()


def test_an_engine_actor_prewarms_its_batches_in_flight_while_the_engine_starts() -> None:
    from eaglenest.regen.stage import PREWARM_PROMPT_TOKENS, _prewarm_capture

    class Recording:
        def __init__(self) -> None:
            self.calls: list[tuple[int, int]] = []

        def prewarm_capture(self, rows: int, batches: int) -> int:
            self.calls.append((rows, batches))
            return 0

    eng = Recording()
    thread = _prewarm_capture(eng, {"batch_size": 8, "batches_in_flight": 3},
                              {"chat": {"max_new_tokens": 16}, "code": {"max_new_tokens": 32}})
    thread.join(5)
    assert eng.calls == [(8 * (PREWARM_PROMPT_TOKENS + 32 + 1), 3)]
    from eaglenest.engines.base import TargetEngine

    assert TargetEngine.prewarm_capture(eng, 8, 3) == 0  # an engine that does not record has nothing to ready


def test_a_batch_with_early_answers_is_written_to_shards_without_losing_a_byte(tmp_path, monkeypatch) -> None:
    """Early answers leave gaps in the batch's memory, so its hidden-state columns are chunked (one chunk per run):
    the engine stage's table goes through the shard writer and reads back byte for byte."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from eaglenest.contracts.shards import shard_files, tensor_to_buffer
    from eaglenest.regen import stage
    from eaglenest.regen.regenerate import Regenerated, Sample
    from eaglenest.regen.stage import ShardDatasink, results_table

    monkeypatch.setattr(stage, "MIN_RUN_BYTES", 1)  # the toy's rows are a few bytes wide: chunk them all the same

    model, sched, rec = setup(tmp_path / "sink")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, V, (n,), generator=g).tolist() for n in (4, 6, 5, 3, 7, 4, 5, 6, 4, 5, 6, 7, 3, 4,
                                                                            5, 6)]
    max_new = [4] * 16
    max_new[5] = 2  # one answer ends early: the rest of the batch after it is a second run
    rids = rec.new_rids(len(prompts))
    assert rec.reserve(rids, prompts, 4)
    gens = sched.generate(prompts, max_new, rids)
    rec.expect(rids, prompts, gens)
    seqs = [p + gen.token_ids + [V - 1] for p, gen in zip(prompts, gens, strict=True)]
    masks = [[0] * len(p) + [1] * len(gen.token_ids) + [0] for p, gen in zip(prompts, gens, strict=True)]
    caps = rec.capture(seqs, [CaptureHint(r, m) for r, m in zip(rids, masks, strict=True)],
                       prefill=lambda s, r: pytest.fail("no prefill"))
    results = [Regenerated(Sample(id=f"s{i}", source="toy", domain="chat", messages=[]), s, m,
                           tensor_to_buffer(c.aux_hidden_states, "float32", states=3),
                           tensor_to_buffer(c.last_hidden_state, "float32"))
               for i, (s, m, c) in enumerate(zip(seqs, masks, caps, strict=True))]
    table = results_table(results)
    assert isinstance(table.column("aux_hidden_states"), pa.ChunkedArray)
    assert table.column("aux_hidden_states").num_chunks == 2  # runs broken once, by the early answer
    assert table.column("aux_hidden_states").chunk(0).buffers()[2].address == caps[0].aux_hidden_states.data_ptr()
    sink = ShardDatasink(tmp_path / "out", rows_per_shard=64, hidden_size=H, storage_dtype="float32")
    assert sink.write([table], None)["samples"] == 16
    (shard,) = shard_files(tmp_path / "out")
    back = {r["id"]: r for r in pq.read_table(shard).to_pylist()}
    for i, cap in enumerate(caps):
        assert back[f"s{i}"]["aux_hidden_states"] == bytes(tensor_to_buffer(cap.aux_hidden_states, "float32", 3))
        assert back[f"s{i}"]["last_hidden_state"] == bytes(tensor_to_buffer(cap.last_hidden_state, "float32"))
    rec.close()


def test_a_recorder_driven_outside_sglang_stops_its_writers_after_the_queued_forwards(tmp_path) -> None:
    """``_Recorder.close``: what a benchmark calls (SGLang's scheduler process simply ends with its daemon writers)."""
    from eaglenest.engines.sglang.hooks import _RECORDERS

    model, sched, rec = setup(tmp_path, writers=2)
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    rids = rec.new_rids(2)
    rec.expect(rids, prompts, sched.generate(prompts, [3, 3], rids))
    recorder = _RECORDERS[str(rec.folder)]
    recorder.close()
    assert not any(t.is_alive() for t in recorder.threads) and recorder.queue.empty()
    assert not recorder.failed and recorder.seq > 0
    rec.close()
