"""Tool calls and reasoning in the target's own output, as OpenAI's ``tool_calls`` and ``reasoning_content``.

A chat model writes a tool call or its reasoning as ordinary output between markers its chat template defines, e.g.
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes / Qwen / the tiny target),
``<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{...}<|tool_call_end|>`` (Kimi-K2 / K2.5,
inside ``<|tool_calls_section_begin|>`` ... ``<|tool_calls_section_end|>``) and
``<think>...</think>`` (Qwen3, DeepSeek-R1, the tiny target). The markers are usually special tokens, which plain
detokenization drops, so the request's text is decoded with :meth:`ChatFormat.decode` (special tokens skipped
except the markers) and split by :class:`ChatParser`.

Reasoning is separated only when asked (``serve.reasoning_parser``, or a request's ``separate_reasoning``, SGLang's
field), as vLLM and SGLang do only with ``--reasoning-parser``; otherwise ``content`` is the whole text, the reasoning
markers included. An unclosed block (the output opened the start marker, or the generation prompt did, and the end
marker never came, e.g. cut by ``max_tokens``) is all reasoning with ``content`` null: vLLM's ``deepseek_r1`` parser
(``BaseThinkingReasoningParser.extract_reasoning``) does the same. Output without a start marker is content (text
before a stray end marker is not reclaimed as reasoning, since a stream has already sent it).

Markers come from ``serve.tool_call_markers`` / ``serve.reasoning_markers`` when set (``[]`` turns parsing off),
otherwise from the target: a known pair is used when the tokenizer's chat template mentions both markers or both
are tokens of its vocabulary. Tool-call bodies are parsed as JSON ``{"name", "arguments"|"parameters"}`` (Kimi's as
``functions.NAME:IDX``, its argument marker and a JSON object, :func:`parse_kimi_body`); a body that does not parse
stays in ``content`` (vLLM's hermes parser keeps it too), so nothing the model wrote is lost.

Tool-call markers never reach ``content``: not around a body that did not parse, not unclosed, not stray (an end
marker with no start), and not when the request offered no tools (the parser then drops the markers and keeps what
is between them as content, which is what plain decoding shows when the markers are special tokens, and makes the
same true of targets whose markers are ordinary tokens or text).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

KIMI_TOOL_CALL = ("<|tool_call_begin|>", "<|tool_call_end|>")
KIMI_ARGUMENT_MARKER = "<|tool_call_argument_begin|>"
KNOWN_TOOL_CALL_MARKERS: tuple[tuple[str, str], ...] = (("<tool_call>", "</tool_call>"), KIMI_TOOL_CALL)
KNOWN_REASONING_MARKERS: tuple[tuple[str, str], ...] = (
    ("<think>", "</think>"), ("<thinking>", "</thinking>"), ("◁think▷", "◁/think▷"))


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str
    """a JSON string, as OpenAI sends it"""

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


@dataclass
class Parsed:
    """What one generation said, split: deltas as they become final (streaming) accumulate here too."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


Delta = tuple[str, Any]
"""("content", str) | ("reasoning", str) | ("tool_call", ToolCall)"""


def _pair(value: Sequence[str] | None) -> tuple[str, str] | None:
    if value is None or len(value) == 0:
        return None
    if len(value) != 2 or not all(value):
        raise ValueError(f"markers must be [start, end], got {list(value)}")
    return value[0], value[1]


def _detect(tokenizer: Any, known: Sequence[tuple[str, str]]) -> tuple[str, str] | None:
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # several named templates
        template = "\n".join(str(t) for t in template.values())
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    for start, end in known:
        if (start in template and end in template) or (start in vocab and end in vocab):
            return start, end
    return None


class ChatFormat:
    """The markers of one target and the decode that keeps them."""

    def __init__(self, tokenizer: Any, *, tool_call: tuple[str, str] | None,
                 reasoning: tuple[str, str] | None) -> None:
        self.tokenizer = tokenizer
        self.tool_call = tool_call
        self.reasoning = reasoning
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        self.vocab: dict[str, int] = vocab
        """the tokenizer's vocabulary, read once: requests look their markers' ids up here (``get_vocab`` builds a
        new dict of every token on each call)"""

        def ids(pair: tuple[str, str] | None) -> set[int]:
            return {vocab[m] for m in pair or () if m in vocab}

        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        for tid, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
            if getattr(tok, "special", False):
                special.add(int(tid))
        inner = {vocab[m] for m in tool_call_syntax(tool_call)[1] if m in vocab}
        # markers the request does not parse are skipped like any special token (plain decoding's text)
        self._drop = {True: frozenset(special - ids(tool_call) - inner - ids(reasoning)),
                      False: frozenset(special - ids(reasoning))}

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, *, tool_call_markers: Sequence[str] | None = None,
                       reasoning_markers: Sequence[str] | None = None) -> ChatFormat:
        """Configured markers win (``[]``: off); None detects them from the template / vocabulary."""
        tool = _pair(tool_call_markers) if tool_call_markers is not None else _detect(tokenizer,
                                                                                       KNOWN_TOOL_CALL_MARKERS)
        think = _pair(reasoning_markers) if reasoning_markers is not None else _detect(tokenizer,
                                                                                        KNOWN_REASONING_MARKERS)
        return cls(tokenizer, tool_call=tool, reasoning=think)

    @property
    def active(self) -> bool:
        return self.tool_call is not None or self.reasoning is not None

    def decode(self, ids: Sequence[int], *, tools: bool = True) -> str:
        """Like ``decode(skip_special_tokens=True)`` but keeping the reasoning markers, and the tool-call markers
        when ``tools`` (the request offered tools)."""
        drop = self._drop[tools]
        return self.tokenizer.decode([int(i) for i in ids if int(i) not in drop], skip_special_tokens=False)

    def starts_in_reasoning(self, prompt_text: str) -> bool:
        """A template that opens the reasoning block in the generation prompt (DeepSeek-R1, Qwen3 thinking)."""
        if self.reasoning is None:
            return False
        start, end = self.reasoning
        tail = prompt_text.rstrip()
        return tail.endswith(start) and not tail.endswith(end)

    def parser(self, *, tools: bool, reasoning: bool = True, prompt_text: str = "") -> ChatParser:
        """A parser of one request: tool calls parsed when ``tools`` (their markers dropped either way), reasoning
        separated when ``reasoning``."""
        return ChatParser(self.tool_call, self.reasoning if reasoning else None,
                          in_reasoning=reasoning and self.starts_in_reasoning(prompt_text), parse_tools=tools)


KIMI_CALL_BODY = re.compile(r"\s*(?P<id>(?:functions\.)?(?P<name>\S+?):\d+)\s*" + re.escape(KIMI_ARGUMENT_MARKER)
                            + r"(?P<args>.*)", re.DOTALL)


def parse_kimi_body(body: str) -> ToolCall | None:
    """Kimi-K2's call between ``<|tool_call_begin|>`` and ``<|tool_call_end|>``: ``functions.NAME:IDX``, the
    argument marker, the arguments as a JSON object (Moonshot's tool-call guidance). The model's own id
    (``functions.get_weather:0``) is the call's id, as Moonshot's guidance and vLLM's ``kimi_k2`` parser return it:
    Kimi's chat template writes it back into the history and names the tool's answer by it. The section markers
    around the calls are special tokens that decoding drops."""
    m = KIMI_CALL_BODY.match(body)
    if m is None:
        return None
    try:
        args = json.loads(m["args"])
    except (json.JSONDecodeError, ValueError):
        return None
    if not isinstance(args, dict):
        return None
    return ToolCall(id=m["id"], name=m["name"], arguments=json.dumps(args, ensure_ascii=False))


def tool_call_syntax(pair: tuple[str, str] | None) -> tuple[Callable[[str], ToolCall | None], tuple[str, ...]]:
    """How a body between these markers reads, and the special tokens inside one that decoding must keep: Kimi's
    ``functions.NAME:IDX<|tool_call_argument_begin|>{...}``, else a JSON object (Hermes / Qwen / the tiny target)."""
    if pair == KIMI_TOOL_CALL:
        return parse_kimi_body, (KIMI_ARGUMENT_MARKER,)
    return parse_tool_body, ()


def parse_tool_body(body: str) -> ToolCall | None:
    """``{"name": ..., "arguments": {...}}`` (or ``parameters``; arguments may already be a JSON string)."""
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, ValueError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", name=obj["name"], arguments=args)


class ChatParser:
    """Incremental split of the output text into content, reasoning and tool calls.

    ``feed`` takes text that is final (after stop strings) and returns the deltas that are certain; a suffix that
    may be the start of a marker is held back until the next feed or ``finish``. Whitespace right after a
    reasoning block or a tool call is dropped (templates put newlines there), and so is content that is only
    whitespace once the model called a tool.
    """

    def __init__(self, tool_call: tuple[str, str] | None, reasoning: tuple[str, str] | None, *,
                 in_reasoning: bool = False, parse_tools: bool = True) -> None:
        self.tool_call = tool_call
        self.tool_body, self.tool_inner = tool_call_syntax(tool_call)
        self.parse_tools = parse_tools
        """False: the request offered no tools; tool-call markers are only dropped"""
        self.reasoning = reasoning
        self.state = "reasoning" if in_reasoning and reasoning else "content"
        self.buf = ""
        self.trim = False
        """drop leading whitespace of the next content (after a reasoning block or a tool call)"""
        self.pending_ws = ""
        self.out = Parsed()

    def _markers(self) -> list[tuple[str, str]]:
        """Markers that matter in content: a tool call starts, reasoning starts, or a stray one is dropped."""
        found = []
        if self.tool_call is not None:
            found += [(self.tool_call[0], "tool" if self.parse_tools else "drop"), (self.tool_call[1], "drop")]
        if self.reasoning is not None:
            found += [(self.reasoning[0], "reasoning"), (self.reasoning[1], "drop")]
        return found

    def _hit(self, marker: str, state: str) -> tuple[int, str, str] | None:
        at = self.buf.find(marker)
        if at < 0:
            return None
        if state == "reasoning" and (self.out.reasoning or self.out.content or self.buf[:at].strip()):
            state = "drop"  # reasoning opens the answer or not at all; a later marker is not shown either
        return at, marker, state

    def feed(self, text: str) -> list[Delta]:
        self.buf += text
        deltas: list[Delta] = []
        while True:
            if self.state == "content":
                hits = [h for h in (self._hit(m, st) for m, st in self._markers()) if h is not None]
                if hits:
                    at, marker, state = min(hits)
                    deltas += self._content(self.buf[:at])
                    self.buf = self.buf[at + len(marker):]
                    if state == "reasoning":
                        self.pending_ws = ""  # template whitespace before the block
                    if state != "drop":
                        self.state = state
                    continue
                keep = _partial_suffix(self.buf, [m for m, _ in self._markers()])
                deltas += self._content(self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                return deltas
            end = self.reasoning[1] if self.state == "reasoning" else self.tool_call[1]  # type: ignore[index]
            at = self.buf.find(end)
            if self.state == "reasoning":
                if at >= 0:
                    deltas += self._reasoning(self.buf[:at])
                    self.buf, self.state, self.trim = self.buf[at + len(end):], "content", True
                    continue
                keep = _partial_suffix(self.buf, [end])
                deltas += self._reasoning(self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                return deltas
            if at < 0:  # inside a tool call: wait for its end
                return deltas
            deltas += self._tool(self.buf[:at])
            self.buf, self.state, self.trim = self.buf[at + len(end):], "content", True

    def finish(self) -> list[Delta]:
        """The generation ended: flush what was held back (an unterminated tool call is kept as content)."""
        rest, self.buf = self.buf, ""
        if self.state == "reasoning":
            return self._reasoning(rest)
        if self.state == "tool":
            call = self.tool_body(rest.strip())
            if call is not None:
                return self._add_call(call)
            self.state = "content"
            return self._content(self._unmarked(rest), force=True)
        deltas = self._content(rest)
        if self.pending_ws and not self.out.tool_calls:
            deltas += self._content("", force=True)
        return deltas

    # ---- deltas
    def _content(self, text: str, *, force: bool = False) -> list[Delta]:
        if self.trim:
            text = text.lstrip()
            if not text:
                return []
            self.trim = False
        text = self.pending_ws + text
        self.pending_ws = ""
        if not force:  # trailing whitespace waits: it is dropped if the next thing is a tool call
            stripped = text.rstrip()
            self.pending_ws = text[len(stripped):]
            text = stripped
        if not text:
            return []
        self.out.content += text
        return [("content", text)]

    def _reasoning(self, text: str) -> list[Delta]:
        if not text:
            return []
        self.out.reasoning += text
        return [("reasoning", text)]

    def _tool(self, body: str) -> list[Delta]:
        call = self.tool_body(body.strip())
        if call is None:  # not a call after all: the model's text stays visible, its markers do not
            self.trim = False
            return self._content(self._unmarked(body), force=True)
        self.pending_ws = ""
        return self._add_call(call)

    def _unmarked(self, text: str) -> str:
        """``text`` without tool-call markers (a body may hold another start marker, or Kimi's argument marker)."""
        for marker in (*(self.tool_call or ()), *self.tool_inner):
            text = text.replace(marker, "")
        return text

    def _add_call(self, call: ToolCall) -> list[Delta]:
        self.pending_ws = ""
        self.out.tool_calls.append(call)
        return [("tool_call", call)]


def _partial_suffix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a marker."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), 0, -1):
            if text.endswith(m[:k]):
                best = max(best, k)
                break
    return best


def parse_all(parser: ChatParser, text: str) -> Parsed:
    """A whole (non-streamed) output through the same parser."""
    parser.feed(text)
    parser.finish()
    return parser.out


# ------------------------------------------------------------------------------------------------ OpenAI fields
def chat_message(parsed: Parsed) -> dict[str, Any]:
    """The assistant message: ``content`` (null next to tool calls or reasoning when empty, as OpenAI and vLLM send
    it), plus ``reasoning_content`` and ``tool_calls`` when the output had them."""
    msg: dict[str, Any] = {"content": parsed.content or (None if parsed.tool_calls or parsed.reasoning else "")}
    if parsed.reasoning:
        msg["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        msg["tool_calls"] = [c.to_openai() for c in parsed.tool_calls]
    return msg


def delta_fields(delta: Delta, parsed: Parsed) -> dict[str, Any]:
    """One parser delta as a streamed ``delta``; a tool call arrives whole, at its index among the calls."""
    kind, value = delta
    if kind == "tool_call":
        return {"tool_calls": [value.to_openai(index=parsed.tool_calls.index(value))]}
    return {"reasoning_content" if kind == "reasoning" else "content": value}


def finish_reason(parsed: Parsed | None, reason: str) -> str:
    """``tool_calls`` when the model ended its turn after calling tools (a cut-off output stays ``length``)."""
    return "tool_calls" if parsed is not None and parsed.tool_calls and reason == "stop" else reason
