"""Regenerate every assistant turn with the target, keep the exact token ids, then capture hidden states.

A conversation is extended turn by turn on the token level: only the text the chat template adds between the end of
the previous turn and the next generation prompt is tokenized, and the target's generated ids are appended as they
came out of the engine. That keeps the ids the target really conditioned on (re-tokenizing a whole conversation can
merge tokens across turn boundaries differently). It needs an append-only chat template; every extension checks the
prefix property, and a sample whose template rewrites earlier text is quarantined with the reason.

Decisions (documented here, tested in tests/component/test_regen_regenerate.py):

- Loss mask = the tokens the target generated, including its end-of-turn token. Prompt segments (system, user and
  tool turns, template markup, generation prompts) are 0.
- A turn that stops at ``max_new_tokens`` without the end-of-turn token is kept (its tokens are genuine target
  output) and closed with the template's end-of-turn token, which gets loss 0 (the target did not generate it), so
  later turns see a well-formed history. Such turns are counted (``truncated_turns``).
- The budget ``max_tokens`` is prompt + regenerated answers: a conversation is extended turn by turn while it fits and
  cut at the last complete assistant turn that does (the later turns are counted in ``dropped_turns``); only when
  not even the first exchange fits is it quarantined ``too_long`` (a first prompt at or over the budget is refused
  before any generation). The original answers' length plays no part: the target replaces them.
- The target's answer enters the history as a structured message (reasoning content, tool calls) when the template
  renders that back to exactly the generated text, else as plain content; if neither reproduces the generated text
  the sample is quarantined ``assistant_render_mismatch`` (the ids would not be what a server shows the target).
- Original tool calls are not replayed: the target writes its own calls, the dataset's tool results are kept.
- Engine failures are isolated: the failing batch is retried one sample at a time and only the samples that fail
  alone are quarantined ``engine_error``.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from eaglenest.contracts.shards import tensor_to_buffer
from eaglenest.engines.base import (
    CaptureHint,
    Generation,
    SamplingParams,
    TargetEngine,
    decode_texts,
    render_chat_text,
)
from eaglenest.regen.formats import (
    ASSISTANT_RENDER_MISMATCH,
    ENGINE_ERROR,
    TEMPLATE_NOT_APPEND_ONLY,
    TOKEN_OUT_OF_RANGE,
    TOO_LONG,
    length_problem,
    parse_tools,
    split_reasoning,
    split_tool_calls,
    template_messages,
)


@dataclass
class Sample:
    """One normalized sample to regenerate (a plan row)."""

    id: str
    source: str
    domain: str
    messages: list[dict[str, Any]]
    tools: str | None = None
    native: bool = False
    native_input_ids: list[int] | None = None
    native_loss_mask: list[int] | None = None
    raw: str = ""
    source_id: str | None = None  # the record's own id in its dataset (or <file>#<index>)


@dataclass
class Regenerated:
    """A finished sample: exact ids, loss mask and the captured hidden states as storage bytes (a view of the
    capture's memory where no conversion was needed: ``contracts.shards.tensor_to_buffer``)."""

    sample: Sample
    input_ids: list[int]
    loss_mask: list[int]
    aux_hidden_states: bytes | memoryview
    last_hidden_state: bytes | memoryview
    generated_tokens: int = 0
    truncated_turns: int = 0
    dropped_turns: int = 0
    assistant_turns: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Quarantined:
    sample: Sample
    reason: str
    detail: str


Result = Regenerated | Quarantined


@dataclass(frozen=True)
class TemplateFacts:
    """Where the chat template ends an assistant turn: the token (and its text) the target emits to stop."""

    turn_end_id: int
    turn_end_text: str

    @classmethod
    def probe(cls, tokenizer: Any, eos_token_ids: Sequence[int]) -> TemplateFacts:
        marker = "\u2063probe\u2063"
        text = render_chat_text(tokenizer, [{"role": "user", "content": "ping"},
                                            {"role": "assistant", "content": marker}], add_generation_prompt=False)
        tail = text[text.index(marker) + len(marker):]
        best: tuple[int, int, str] | None = None
        for tid in eos_token_ids:
            tok = tokenizer.convert_ids_to_tokens(int(tid))
            pos = tail.find(tok) if tok else -1
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, int(tid), tok)
        if best is None:
            raise ValueError(
                f"the chat template does not end an assistant turn with any EOS token {list(eos_token_ids)} "
                f"(text after the answer: {tail!r}); regen needs the target's end-of-turn token to be an EOS token "
                "(set eos_token_id in generation_config.json)")
        return cls(turn_end_id=best[1], turn_end_text=best[2])


@dataclass
class _State:
    sample: Sample
    msgs: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    slots: list[int]
    sampling: SamplingParams
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    text: str = ""
    hist: list[dict[str, Any]] = field(default_factory=list)
    pos: int = 0
    slot: int = 0
    boundary: int = 0
    kept: int = 0
    generated: int = 0
    truncated: int = 0
    dropped: int = 0
    turns: list[dict[str, Any]] = field(default_factory=list)
    failure: tuple[str, str] | None = None
    done: bool = False
    capture_ref: str | None = None
    """the engine's handle on the states it recorded during this sample's last generation (if it records any)"""

    def fail(self, reason: str, detail: str) -> None:
        self.failure = (reason, detail)


@dataclass
class BatchStats:
    generated_tokens: int = 0
    generate_seconds: float = 0.0
    capture_seconds: float = 0.0
    generate_from: float | None = None  # wall clock: the first generate call started, the last one returned
    generate_to: float | None = None
    captured_tokens: int = 0


class Regenerator:
    """Runs whole batches through one engine: turn-synchronous generation, then one capture call."""

    def __init__(self, engine: TargetEngine, *, min_tokens: int, max_tokens: int, storage_dtype: str,
                 layer_ids: Sequence[int] | None = None):
        self.engine = engine
        self.tok = engine.tokenizer
        self.min_tokens = min_tokens
        self.max_tokens = max_tokens
        self.storage_dtype = storage_dtype
        self.layer_ids = list(layer_ids) if layer_ids is not None else list(getattr(engine, "aux_layer_ids", []))
        self.eos_ids = set(engine.info.eos_token_ids)
        self.facts = TemplateFacts.probe(self.tok, engine.info.eos_token_ids)
        self.stats = BatchStats()

    # ------------------------------------------------------------------------------------------------ public
    def run(self, samples: Sequence[Sample], sampling_for: Callable[[Sample], SamplingParams]) -> list[Result]:
        """Regenerate and capture a batch; every sample comes back as Regenerated or Quarantined, in order."""
        self.stats = BatchStats()
        states = [self._start(s, sampling_for(s)) for s in samples]
        self._open_turns([st for st in states if not st.sample.native and st.failure is None])
        self._generate_all([st for st in states if not st.sample.native])
        return self._capture_all(states)

    # ----------------------------------------------------------------------------------------------- per sample
    def _render(self, messages: list[dict[str, Any]], tools: Any, gen: bool) -> str:
        return render_chat_text(self.tok, messages, tools=tools, add_generation_prompt=gen)

    def _encode_many(self, texts: list[str]) -> list[list[int]]:
        """``tok.encode(t, add_special_tokens=False)`` of each text, in one call: at the start of a regen wave a
        dozen batches prepare their prompts together under one GIL, and the per-call wrapper costs more than the
        tokenizing (a fast tokenizer's batch call runs in its backend)."""
        if not any(texts):
            return [[] for _ in texts]
        return [list(ids) for ids in self.tok(texts, add_special_tokens=False)["input_ids"]]

    def _start(self, s: Sample, sampling: SamplingParams) -> _State:
        if s.native:
            st = _State(s, [], None, [], sampling, ids=list(s.native_input_ids or []),
                        mask=list(s.native_loss_mask or []), done=True)
            self._check_native(st)
            return st
        msgs = template_messages(s.messages)
        tools = parse_tools(s.tools)
        slots = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        if msgs and msgs[-1]["role"] != "assistant":
            slots.append(len(msgs))  # a trailing user/tool turn gets an answer too
        return _State(s, msgs, tools, slots, sampling)  # its first turn is opened with the batch's (run)

    def _check_native(self, st: _State) -> None:
        problem = length_problem(len(st.ids), self.min_tokens, self.max_tokens)
        if problem:
            st.fail(*problem)
            return
        vocab = self.engine.info.vocab_size
        bad = sorted({t for t in st.ids if t >= vocab})
        if bad:
            st.fail(TOKEN_OUT_OF_RANGE, f"token ids {bad[:5]} >= the target's vocab_size {vocab}")

    def _open_turn(self, st: _State) -> None:
        """Append the prompt segment up to the next generation prompt (user/tool/system turns of the dataset)."""
        self._open_turns([st])

    def _open_turns(self, states: list[_State]) -> None:
        """:meth:`_open_turn` for each state, the new segments tokenized together. No length filter on the original
        answers: the target's own answers decide."""
        pending: list[tuple[_State, str, list[dict[str, Any]], int]] = []
        for st in states:
            k = st.slots[st.slot]
            hist = st.hist + st.msgs[st.pos:k]
            text = self._render(hist, st.tools, gen=True)
            if not text.startswith(st.text):
                st.fail(TEMPLATE_NOT_APPEND_ONLY,
                        f"rendering up to turn {k} changes earlier text at char {_diverge(st.text, text)}: "
                        f"{st.text[_diverge(st.text, text):][:60]!r} -> {text[_diverge(st.text, text):][:60]!r}")
                continue
            pending.append((st, text, hist, k))
        segs = self._encode_many([text[len(st.text):] for st, text, _, _ in pending])
        for (st, text, hist, k), seg in zip(pending, segs, strict=True):
            st.ids += seg
            st.mask += [0] * len(seg)
            st.text, st.hist, st.pos = text, hist, k
            if len(st.ids) >= self.max_tokens:
                self._cut(st, f"the prompt of assistant turn {st.slot + 1} reaches {len(st.ids)} tokens")

    def _body(self, toks: Sequence[int]) -> list[int]:
        """An answer's ids without its final EOS (the text the template must render back)."""
        return list(toks[:-1]) if toks and toks[-1] in self.eos_ids else list(toks)

    def _close_turn(self, st: _State, gen: Generation, body: list[int], body_text: str) -> None:
        """Append the target's answer (exact ids; ``body``: :meth:`_body` of them, ``body_text`` its text), check the
        template renders it back, move to the next turn."""
        toks = list(gen.token_ids)
        st.generated += len(toks)
        ended = bool(toks) and toks[-1] == self.facts.turn_end_id
        expected = body_text + self.facts.turn_end_text
        chosen = None
        for cand in _answer_candidates(body_text):
            full = self._render(st.hist + [cand], st.tools, gen=False)
            if not full.startswith(st.text):
                st.fail(TEMPLATE_NOT_APPEND_ONLY,
                        f"adding the target's answer to turn {st.slot + 1} changes earlier text at char "
                        f"{_diverge(st.text, full)}")
                return
            if full[len(st.text):].startswith(expected):
                chosen = cand
                break
        if chosen is None:
            full = self._render(st.hist + [{"role": "assistant", "content": body_text}], st.tools, gen=False)
            st.fail(ASSISTANT_RENDER_MISMATCH,
                    f"the template renders the target's answer of turn {st.slot + 1} as "
                    f"{full[len(st.text):][:80]!r}, the target generated {expected[:80]!r}")
            return
        st.ids += body + [self.facts.turn_end_id]
        st.mask += [1] * len(body) + [1 if ended else 0]
        st.truncated += not ended
        st.text += expected
        st.hist.append(chosen)
        st.turns.append({"text": body_text, "ended": ended, "tokens": len(body) + 1})
        st.pos = st.slots[st.slot] + 1
        st.slot += 1
        if len(st.ids) > self.max_tokens:
            self._cut(st, f"assistant turn {st.slot} ends at {len(st.ids)} tokens")
            return
        st.boundary, st.kept = len(st.ids), len(st.turns)
        if st.slot == len(st.slots):
            st.done = True
        else:
            self._open_turn(st)

    def _cut(self, st: _State, why: str) -> None:
        """Keep the complete turns that fit in ``max_tokens``; with none, the sample is too long."""
        if st.boundary == 0:
            st.fail(TOO_LONG, f"{why} > max_tokens {self.max_tokens} before any complete turn")
            return
        st.dropped = len(st.slots) - st.kept
        st.turns = st.turns[:st.kept]
        st.truncated = sum(not t["ended"] for t in st.turns)
        st.ids, st.mask = st.ids[:st.boundary], st.mask[:st.boundary]
        st.done = True

    # ------------------------------------------------------------------------------------------- engine calls
    def _generate_all(self, states: list[_State]) -> None:
        while True:
            active = [st for st in states if st.failure is None and not st.done]
            if not active:
                return
            groups: dict[SamplingParams, list[_State]] = defaultdict(list)
            for st in active:
                groups[st.sampling].append(st)
            for sampling, group in groups.items():
                t0 = time.perf_counter()
                if self.stats.generate_from is None:
                    self.stats.generate_from = time.time()
                outs = _isolated(lambda g, sp=sampling: self.engine.generate_ids([st.ids for st in g], sp), group)
                self.stats.generate_seconds += time.perf_counter() - t0
                self.stats.generate_to = time.time()
                bodies = [None if isinstance(out, BaseException) else self._body(out.token_ids) for out in outs]
                texts = iter(decode_texts(self.tok, [b for b in bodies if b is not None], skip_special_tokens=False,
                                          clean_up_tokenization_spaces=False))
                for st, out, body in zip(group, outs, bodies, strict=True):
                    if isinstance(out, BaseException):
                        st.fail(ENGINE_ERROR, f"generate: {type(out).__name__}: {out}"[:500])
                    else:
                        self.stats.generated_tokens += len(out.token_ids)
                        st.capture_ref = out.meta.get("capture_ref")
                        self._close_turn(st, out, body, next(texts))

    def _capture_all(self, states: list[_State]) -> list[Result]:
        ready = [st for st in states if st.failure is None]
        for st in ready:
            if st.sample.native:
                continue
            problem = length_problem(len(st.ids), self.min_tokens, self.max_tokens)
            if problem:
                st.fail(*problem)
        ready = [st for st in ready if st.failure is None]
        t0 = time.perf_counter()
        caps = _isolated(lambda g: self.engine.capture([st.ids for st in g], self.layer_ids, hints=_hints(g)),
                         ready) if ready else []
        self.stats.capture_seconds += time.perf_counter() - t0
        h = self.engine.info.hidden_size
        captured: dict[int, Any] = {}
        for st, cap in zip(ready, caps, strict=True):
            if isinstance(cap, BaseException):
                st.fail(ENGINE_ERROR, f"capture: {type(cap).__name__}: {cap}"[:500])
                continue
            t = len(st.ids)
            aux, last = cap.aux_hidden_states, cap.last_hidden_state
            if tuple(aux.shape) != (t, 3 * h) or tuple(last.shape) != (t, h):
                st.fail(ENGINE_ERROR, f"capture returned aux {tuple(aux.shape)} / last {tuple(last.shape)} for "
                                      f"{t} tokens (want [{t}, {3 * h}] / [{t}, {h}])")
                continue
            self.stats.captured_tokens += t
            captured[id(st)] = (tensor_to_buffer(aux, self.storage_dtype, states=3),
                                tensor_to_buffer(last, self.storage_dtype))
        results: list[Result] = []
        for st in states:
            if st.failure is not None:
                results.append(Quarantined(st.sample, *st.failure))
                continue
            aux_b, last_b = captured[id(st)]
            results.append(Regenerated(st.sample, st.ids, st.mask, aux_b, last_b, generated_tokens=st.generated,
                                       truncated_turns=st.truncated, dropped_turns=st.dropped,
                                       assistant_turns=st.turns))
        return results


def _hints(states: list[_State]) -> list[CaptureHint | None] | None:
    """Per sequence, what lets the engine reuse states it recorded while generating (None: nothing recorded)."""
    hints = [CaptureHint(st.capture_ref, st.mask) if st.capture_ref else None for st in states]
    return hints if any(hints) else None


def _answer_candidates(body_text: str) -> list[dict[str, Any]]:
    """The target's answer as a structured message (reasoning, tool calls) first, then as plain content."""
    reasoning, rest = split_reasoning(body_text)
    content, calls = split_tool_calls(rest)
    structured: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        structured["reasoning_content"] = reasoning
    if calls:
        structured["tool_calls"] = calls
    plain = {"role": "assistant", "content": body_text}
    return [structured, plain] if structured != plain else [plain]


def _isolated(call: Callable[[list[_State]], list[Any]], group: list[_State]) -> list[Any]:
    """Run ``call`` on the whole group; on failure retry one by one so only the failing samples carry the error."""
    try:
        out = call(group)
        if len(out) != len(group):
            raise RuntimeError(f"engine returned {len(out)} results for {len(group)} inputs")
        return list(out)
    except Exception as e:  # noqa: BLE001 - any engine failure is isolated, never fatal
        if len(group) == 1:
            return [e]
    results: list[Any] = []
    for st in group:
        try:
            results.append(call([st])[0])
        except Exception as e:  # noqa: BLE001
            results.append(e)
    return results


def _diverge(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
