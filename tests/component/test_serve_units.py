"""Pieces of the serve layer that need no Ray: streaming detokenization, parameter checks, deployment options."""

from __future__ import annotations

import pytest

from eaglenest.config import EaglenestConfig
from eaglenest.serve.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    chat_messages,
    check_sampling,
)
from eaglenest.serve.text import StreamText


@pytest.fixture(scope="module")
def tokenizer(tiny_target_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_target_path))


def _stream(tokenizer, ids, stop=(), sizes=(1,)):
    text = StreamText(lambda t: tokenizer.decode(t, skip_special_tokens=True), stop)
    pieces, i, k = [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)]
        pieces.append(text.feed(ids[i:i + n]))
        i, k = i + n, k + 1
    pieces.append(text.finish())
    return "".join(pieces), text


@pytest.mark.parametrize("sizes", [(1,), (3,), (1, 4, 2)])
def test_stream_pieces_concatenate_to_the_full_text(tokenizer, sizes):
    ids = tokenizer.encode("Here they are: 8, 8, 29. That is café — naïve ünïcode! 12 * 7 = 84.")
    joined, _ = _stream(tokenizer, ids, sizes=sizes)
    assert joined == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("sizes", [(1,), (2,), (5,)])
def test_stop_string_is_cut_even_across_tokens(tokenizer, sizes):
    full = "The sum is 42. Next sentence here."
    ids = tokenizer.encode(full)
    joined, text = _stream(tokenizer, ids, stop=("42. N",), sizes=sizes)
    assert joined == "The sum is " and text.stopped
    joined, text = _stream(tokenizer, ids, stop=("zzz",), sizes=sizes)  # a stop that never comes holds nothing back
    assert joined == tokenizer.decode(ids, skip_special_tokens=True) and not text.stopped


def test_check_sampling_names_the_bad_param():
    def req(**kw):
        return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                     **kw})

    cases = {"temperature": {"temperature": -0.5}, "top_p": {"top_p": 0}, "n": {"n": 2},
             "max_tokens": {"max_tokens": 10_000}, "stop": {"stop": ["a", "b", "c", "d", "e"]},
             "frequency_penalty": {"frequency_penalty": 0.5}, "bogus_arg": {"bogus_arg": 1}}
    for param, kw in cases.items():
        r = req(**kw)
        with pytest.raises(APIError) as e:
            check_sampling(r, max_tokens=r.max_tokens, max_tokens_limit=64)
        assert e.value.status == 400 and e.value.param == param, (param, e.value.message)
    ok = check_sampling(req(temperature=0, stop="\n", seed=3), max_tokens=None, max_tokens_limit=64)
    assert (ok.max_tokens, ok.temperature, ok.stop, ok.seed) == (64, 0.0, ("\n",), 3)


def test_messages_accept_text_parts_and_refuse_images():
    r = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert chat_messages(r) == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]
    r = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    with pytest.raises(APIError, match="only text parts"):
        chat_messages(r)
    assert CompletionRequest.model_validate({"model": "m", "prompt": [1, 2, 3]}).prompt == [1, 2, 3]


def test_deployment_options_follow_the_config():
    from eaglenest.serve.deployment import deployment_options

    cfg = EaglenestConfig.model_validate({"serve": {"num_replicas": 3, "num_cpus_per_replica": 2,
                                                    "num_gpus_per_replica": 1, "max_concurrent_requests": 32}})
    opts = deployment_options(cfg)
    assert opts["num_replicas"] == 3
    assert opts["ray_actor_options"] == {"num_cpus": 2, "num_gpus": 1}
    assert opts["max_ongoing_requests"] > 32  # excess requests reach the replica and get a clear 429
    auto = deployment_options(EaglenestConfig.model_validate(
        {"serve": {"autoscaling": {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8}}}))
    assert "num_replicas" not in auto and auto["autoscaling_config"]["max_replicas"] == 4


@pytest.mark.parametrize("events, ok", [
    ([{"choices": [{"index": 0, "delta": {"content": "x"}}]}, "[DONE]"], True),
    ([{"error": {"message": "m", "type": "server_error"}}, "[DONE]"], True),
    ([{"choices": [{"index": 0, "delta": {}}], "created": "now"}, "[DONE]"], False),  # a chunk of the wrong shape
    ([{"choices": [], "object": "chat.completion"}], False),                        # not a chunk
    (["hello", "[DONE]"], False),                                                   # neither JSON nor [DONE]
])
def test_the_documented_event_stream_is_checked_chunk_by_chunk(events, ok):
    """/openapi.json's text/event-stream schema describes each event (OpenAPI 3.1) and its data as JSON
    (contentSchema) or [DONE]: schemathesis' response check, which the e2e runs against the server, rejects a stream
    whose chunks break the chunk schema, not only one whose data is not a string."""
    import json

    import requests
    import schemathesis
    from schemathesis.checks import content_type_conformance, response_schema_conformance
    from schemathesis.core.failures import FailureGroup
    from schemathesis.core.transport import Response

    from eaglenest.serve.deployment import api

    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    body = "".join(f"data: {e if isinstance(e, str) else json.dumps({**chunk, **e})}\n\n" for e in events)
    op = schemathesis.openapi.from_dict(api.openapi())["/v1/chat/completions"]["POST"]
    request = requests.Request("POST", "http://x/v1/chat/completions", json={}).prepare()
    response = Response(200, {"content-type": ["text/event-stream"]}, body.encode(), request, 0.0, True,
                        encoding="utf-8")
    case = op.Case(body={"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True})
    checks = [content_type_conformance, response_schema_conformance]
    if ok:
        case.validate_response(response, checks=checks)
    else:
        with pytest.raises(FailureGroup, match="SSE event violates schema"):
            case.validate_response(response, checks=checks)


def test_build_app_refuses_unknown_args_and_a_bad_drafter(tmp_path, tiny_target_path):
    from serve_helpers import make_drafter

    from eaglenest.drafters.preflight import PreflightError
    from eaglenest.serve.app import build_app

    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"target:\n  model: {tiny_target_path}\n  device: cpu\nserve:\n  spec:\n    algorithm: EAGLE\n")
    with pytest.raises(ValueError, match="unknown application args"):
        build_app({"config": str(cfg), "drafter_dir": "x"})
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_app({"config": str(cfg), "drafter": str(tmp_path / "missing")})
    d = make_drafter(tmp_path / "d", tiny_target_path)
    with pytest.raises(PreflightError, match="algorithm EAGLE3"):
        build_app({"config": str(cfg), "drafter": str(d)})
    cfg.write_text(f"target:\n  model: {tiny_target_path}\n  device: cpu\n")
    app = build_app({"config": str(cfg), "drafter": str(d)})
    assert type(app).__name__ == "Application"


@pytest.fixture(scope="module", params=["decoder-process", "decoder-thread"])
def spec_backend(request, tiny_target_path, tmp_path_factory):
    from serve_helpers import make_drafter

    from eaglenest.serve.backends import make_backend

    drafter = make_drafter(tmp_path_factory.mktemp("units") / "drafter", tiny_target_path)
    cfg = EaglenestConfig.model_validate({"target": {"model": str(tiny_target_path), "device": "cpu",
                                                     "dtype": "float32"}, "serve": {"max_batch_size": 8}})
    backend = make_backend(cfg, str(drafter), decoder_process=request.param == "decoder-process")
    assert type(backend).__name__ == ("ProcessBackend" if request.param == "decoder-process" else "Backend")
    yield backend
    backend.close()


def test_scheduler_lets_late_requests_in_and_keeps_greedy_exact(spec_backend, tiny_engine):
    """A request that arrives while another decodes starts at the next step, not after that request finishes."""
    import threading
    import time

    from eaglenest.engines.base import SamplingParams
    from eaglenest.serve.backends import Job

    prompts = {"long": ("Count from 1 to 50.", 80), "b": ("List three colors.", 32), "c": ("Hello! Who are you?", 32)}
    events: dict[str, list] = {k: [] for k in prompts}
    done = {k: threading.Event() for k in prompts}

    def submit(key: str) -> None:
        text, n = prompts[key]

        def sink(ev, key=key) -> None:
            events[key].append((time.perf_counter(), ev))
            if ev.final:
                done[key].set()

        ids = spec_backend.render_chat([{"role": "user", "content": text}])
        spec_backend.submit(Job(ids, SamplingParams(temperature=0.0, max_new_tokens=n), sink))

    submit("long")
    deadline = time.monotonic() + 60
    while len(events["long"]) < 3 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert not done["long"].is_set()
    submit("b")
    submit("c")
    for d in done.values():
        assert d.wait(120)
    long_end = events["long"][-1][0]
    for key in ("b", "c"):
        first_token = next(t for t, ev in events[key] if ev.token_ids)
        assert first_token < long_end, f"{key} waited for the running request to finish"
    for key, (text, n) in prompts.items():
        ids = [t for _, ev in events[key] for t in ev.token_ids]
        want = tiny_engine.generate([[{"role": "user", "content": text}]],
                                    SamplingParams(temperature=0.0, max_new_tokens=n))[0]
        assert ids == want.token_ids, key
        final = events[key][-1][1]
        assert final.error is None and final.finish_reason == want.finish_reason
        st = final.stats  # every verify step emits 1 + its accepted drafts (the last one may be cut at EOS)
        assert st.verify_steps + 1 <= len(ids) <= 1 + st.verify_steps + st.accepted_tokens
        assert st.draft_tokens == 3 * st.verify_steps  # chain of 3 drafts per step (serve.spec default)


class _StreamingSGLang:
    """Stands in for ``sglang.Engine`` (which needs a GPU) with the streaming surface 0.5.14 has: ``loop``,
    ``async_generate(stream=True)`` yielding cumulative chunks (no finish reason until the last, which carries the
    whole output and meta_info), and ``tokenizer_manager.abort_request(rid)``. One token per scheduler tick."""

    def __init__(self, outputs: dict[tuple[int, ...], dict]) -> None:
        import asyncio

        self.loop = asyncio.new_event_loop()
        self.outputs = outputs
        self.aborted: list[str] = []
        self.opened: list[str] = []
        self.tokenizer_manager = self

    def abort_request(self, rid: str) -> None:
        import asyncio

        asyncio.get_running_loop()  # sglang's asyncio ZMQ socket sends only from inside the engine's loop
        self.aborted.append(rid)

    async def async_generate(self, *, input_ids, sampling_params, stream, rid, return_logprob=False,
                             top_logprobs_num=0, logprob_start_len=-1):
        assert stream is True and isinstance(sampling_params, dict)
        self.opened.append(rid)
        final = self.outputs[tuple(input_ids)]

        def logprobs(ids):  # sglang's cumulative (logprob, token id, text) triples and top alternatives
            if not return_logprob:
                return {}
            return {"output_token_logprobs": [(-0.1 * t, t, None) for t in ids],
                    "output_top_logprobs": [[(-0.01 * a, a, None) for a in range(top_logprobs_num)] for _ in ids]}

        async def chunks():
            import asyncio

            ids = final["output_ids"]
            for n in range(1, len(ids)):
                await asyncio.sleep(0.001)
                if rid in self.aborted:
                    return
                yield {"output_ids": ids[:n], "meta_info": {"finish_reason": None, "id": rid, **logprobs(ids[:n])}}
            await asyncio.sleep(0.001)
            yield {**final, "meta_info": {**final["meta_info"], **logprobs(ids)}}

        return chunks()


def _sglang_decoder(outputs):
    from eaglenest.engines.sglang.stream import SGLangStreams
    from eaglenest.serve.backends import SGLangDecoder

    fake = _StreamingSGLang(outputs)

    class Engine:  # SGLangEngine's surface the adapter uses: streams() and launch
        launch = type("Launch", (), {"algorithm": "EAGLE3"})()

        def streams(self):
            return SGLangStreams(fake, vocab_size=100, eos_token_ids=(2,), decode=lambda t: " ".join(map(str, t)))

    return SGLangDecoder(Engine(), max_batch=8), fake


_SPEC_OUT = {"output_ids": [5, 6, 7, 8, 9], "meta_info": {  # meta_info as sglang 0.5.14 returns it (EOS trimmed)
    "finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 4, "completion_tokens": 6,
    "spec_verify_ct": 3, "spec_accept_length": 2.0, "spec_num_correct_drafts": 3, "spec_num_proposed_drafts": 9}}
_LEN_OUT = {"output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "length"}, "prompt_tokens": 2,
                                                 "completion_tokens": 2}}


def _run(group, until, limit=500):
    for _ in range(limit):
        if until():
            return
        group.step()
    raise AssertionError("the group did not get there")


def test_sglang_adapter_streams_tokens_and_maps_meta_to_usage_spec():
    """SGLang cannot run here: the adapter runs on a stand-in with SGLang's streaming contract."""
    from eaglenest.engines.base import SamplingParams
    from eaglenest.serve.backends import Job

    dec, fake = _sglang_decoder({(1, 2, 3, 4): _SPEC_OUT, (1, 2): _LEN_OUT})
    assert dec.speculative and dec.algorithm == "EAGLE3"
    events: list[list] = [[], []]
    jobs = [Job([1, 2, 3, 4], SamplingParams(), events[0].append), Job([1, 2], SamplingParams(), events[1].append)]
    assert dec.key(jobs[0]) == dec.key(jobs[1])
    group = dec.new_group(SamplingParams())
    for j in jobs:
        group.add(j)
    _run(group, lambda: group.alive == 0)
    assert len(fake.opened) == 2
    assert sum(not ev.final for ev in events[0]) >= 2  # tokens arrived before the end, in several chunks
    assert [t for ev in events[0] for t in ev.token_ids] == [5, 6, 7, 8, 9, 2]  # the matched EOS kept, once
    first, second = events[0][-1], events[1][-1]
    assert first.finish_reason == "stop" and all(ev.finish_reason is None for ev in events[0][:-1])
    assert (first.stats.verify_steps, first.stats.draft_tokens, first.stats.accepted_tokens) == (3, 9, 3)
    assert first.stats.accept_length == 2.0  # = completion_tokens / verify steps, SGLang's own figure
    assert second.finish_reason == "length" and second.stats.accept_length == 1.0
    assert [t for ev in events[1] for t in ev.token_ids] == [5, 6]


def test_sglang_adapter_admits_mid_stream_cancels_and_refuses_bad_prompts():
    from eaglenest.engines.base import SamplingParams
    from eaglenest.serve.backends import Job

    long = {"output_ids": list(range(10, 60)), "meta_info": {"finish_reason": {"type": "length"},
                                                            "prompt_tokens": 1, "completion_tokens": 50}}
    dec, fake = _sglang_decoder({(7,): long, (8,): dict(long), (1, 2): _LEN_OUT})
    events: dict[str, list] = {"a": [], "b": [], "late": [], "bad": []}
    a, b = Job([7], SamplingParams(), events["a"].append), Job([8], SamplingParams(), events["b"].append)
    group = dec.new_group(SamplingParams())
    group.add(a)
    group.add(b)
    _run(group, lambda: len(events["a"]) >= 3)
    late = Job([1, 2], SamplingParams(), events["late"].append)
    group.add(late)  # joins while the others run, and finishes first
    group.add(Job([1, 500], SamplingParams(), events["bad"].append))  # outside the vocab: refused alone
    assert "outside the vocab" in events["bad"][-1].error
    a.cancel()
    _run(group, lambda: late.finished and a.finished)
    assert events["a"][-1].error == "cancelled" and len(fake.aborted) == 1
    assert not b.finished  # the long one is still running when the late one is done
    _run(group, lambda: group.alive == 0)
    assert [t for ev in events["b"] for t in ev.token_ids] == list(range(10, 60))
    assert events["late"][-1].finish_reason == "length"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread dies on purpose
def test_engine_starts_with_the_backend_and_a_failed_start_marks_it_dead():
    import time

    from eaglenest.engines.base import SamplingParams
    from eaglenest.serve.backends import Backend, Job, SGLangDecoder

    class Engine:  # SGLangEngine's lazily started ``engine`` property, failing the way a GPU-less start does
        launch = None
        started = 0

        @property
        def engine(self):
            Engine.started += 1
            raise RuntimeError("CUDA error: no CUDA-capable device is detected")

        def close(self):
            pass

    backend = Backend(Engine(), SGLangDecoder(Engine(), max_batch=4), name="sglang")
    backend.start()
    deadline = time.time() + 10
    while backend.alive and time.time() < deadline:
        time.sleep(0.01)
    assert Engine.started == 1 and not backend.alive
    assert "no CUDA-capable device" in backend.fatal
    assert backend.warmed.is_set(), "a failed start ends the wait of a decoder process for its engine"
    with pytest.raises(RuntimeError, match="no CUDA-capable device"):
        backend.submit(Job([1, 2], SamplingParams(), lambda ev: None))
    backend.close(timeout=1)


def test_warmed_waits_for_an_engine_that_starts_on_the_worker_thread():
    """A decoder process says it is ready only after ``warmed``: serve.route starts the speculative engine once the
    plain one holds its GPU memory."""
    import threading

    from eaglenest.serve.backends import Backend, SGLangDecoder

    release = threading.Event()

    class Engine:  # SGLangEngine's lazily started ``engine`` property, starting slowly
        launch = None

        @property
        def engine(self):
            release.wait(10)
            return self

        def close(self):
            pass

    backend = Backend(Engine(), SGLangDecoder(Engine(), max_batch=4), name="sglang")
    backend.start()
    assert not backend.warmed.wait(0.3), "ready before the engine started"
    release.set()
    assert backend.warmed.wait(10) and backend.alive and backend.fatal is None
    backend.close(timeout=2)


def test_streamed_request_turns_cumulative_chunks_into_deltas():
    from eaglenest.engines.sglang.args import SGLangOutputError, StreamedRequest

    sr = StreamedRequest(prompt_len=3, decode=lambda t: "".join(chr(96 + x) for x in t), stop=["c"])
    assert sr.feed({"output_ids": [1], "meta_info": {"finish_reason": None}}) == [1]
    assert sr.feed({"output_ids": [1], "meta_info": {"finish_reason": None}}) == []
    assert sr.feed({"output_ids": [1, 2, 3], "meta_info": {"finish_reason": None}}) == [2, 3]
    last = sr.feed({"output_ids": [1, 2, 3, 4], "meta_info": {"finish_reason": {"type": "stop", "matched": 9}}})
    assert last == [4, 9] and sr.result.token_ids == [1, 2, 3, 4, 9]
    assert sr.result.text == "ab" and sr.result.finish_reason == "stop"  # cut at the stop string, as unstreamed
    back = StreamedRequest(prompt_len=1, decode=str)
    back.feed({"output_ids": [1, 2], "meta_info": {"finish_reason": None}})
    with pytest.raises(SGLangOutputError, match="incremental_streaming_output"):
        back.feed({"output_ids": [3], "meta_info": {"finish_reason": None}})


def test_a_cancelled_request_leaves_the_batch_and_the_others_stay_exact(spec_backend, tiny_engine):
    import threading

    from eaglenest.engines.base import SamplingParams
    from eaglenest.serve.backends import Job

    sp = SamplingParams(temperature=0.0, max_new_tokens=120, ignore_eos=True)  # the long one runs long
    prompts = ["Count from 1 to 50.", "Write a short poem about the sea."]
    events: list[list] = [[], []]
    done = [threading.Event(), threading.Event()]
    jobs = []
    for i, p in enumerate(prompts):
        def sink(ev, i=i) -> None:
            events[i].append(ev)
            if len(events[i]) == 3 and i == 0:
                jobs[0].cancel()  # the client of the long request goes away mid-stream
            if ev.final:
                done[i].set()
        jobs.append(Job(spec_backend.render_chat([{"role": "user", "content": p}]), sp, sink))
    for j in jobs:
        spec_backend.submit(j)
    assert done[0].wait(120) and done[1].wait(120)
    assert events[0][-1].error == "cancelled"
    long_tokens = sum(len(ev.token_ids) for ev in events[0])
    want_long = tiny_engine.generate([[{"role": "user", "content": prompts[0]}]], sp)[0]
    assert long_tokens < len(want_long.token_ids)  # it stopped early
    want = tiny_engine.generate([[{"role": "user", "content": prompts[1]}]], sp)[0]
    assert [t for ev in events[1] for t in ev.token_ids] == want.token_ids


def test_every_serve_metric_the_monitoring_uses_is_emitted():
    """alerts.yml and the dashboard query ray_<name>[_total|_bucket|_sum|_count]; each name must be one we emit."""
    import re
    from pathlib import Path

    from eaglenest.contracts.metrics import SERVE_ROUTE, SERVE_SCHEDULE, TRAFFIC
    from eaglenest.serve.metrics import METRIC_NAMES

    # serve.schedule's, serve.route's and the traffic log's series are serve's too
    METRIC_NAMES = (*METRIC_NAMES, *(m.name for m in SERVE_SCHEDULE + SERVE_ROUTE + TRAFFIC))  # noqa: N806
    root = Path(__file__).resolve().parents[2] / "monitoring"
    used = set()
    for f in list(root.glob("*.yml")) + list(root.glob("*.json")):
        used |= set(re.findall(r"ray_(eaglenest_serve_[a-z_]+)", f.read_text()))
    assert used, "monitoring/ queries no serve metric"
    for name in used:
        base = re.sub(r"_(total|bucket|sum|count)$", "", name)
        assert base in METRIC_NAMES or name in METRIC_NAMES, f"monitoring queries {name}, serve emits {METRIC_NAMES}"


def test_sglang_adapter_passes_logprobs_through():
    """A request with logprobs asks SGLang for them (return_logprob, top_logprobs_num) and every token SGLang
    reported arrives with its logprob and alternatives; the EOS SGLang trimmed (and we put back) has none."""
    from eaglenest.engines.base import SamplingParams
    from eaglenest.serve.backends import Job

    dec, _ = _sglang_decoder({(1, 2, 3, 4): _SPEC_OUT})
    events: list = []
    sampling = SamplingParams(logprobs=2)
    group = dec.new_group(sampling)
    group.add(Job([1, 2, 3, 4], sampling, events.append))
    _run(group, lambda: group.alive == 0)
    entries = [e for ev in events for e in (ev.logprobs or [])]
    assert [t for ev in events for t in ev.token_ids] == [5, 6, 7, 8, 9, 2]
    assert entries == [(t, -0.1 * t, [(0, -0.0), (1, -0.01)]) for t in [5, 6, 7, 8, 9]]
