"""Source formats -> one conversation schema, and the quarantine rules for rows that do not fit.

Every dataset row becomes either a normalized sample (``id``, ``source``, ``domain``, ``messages``, ``tools``,
``native``) or a quarantine record with a specific reason; nothing is dropped silently and no row can stop the job.

Ids are content hashes of what regeneration depends on (system/user/tool turns, the positions of assistant turns,
the tools), so the same prompt in two datasets is one sample, and an id never changes between runs. The original
assistant answers are kept (they count for the length filter) but do not enter the id: the target replaces them.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

# ----------------------------------------------------------------------------------------------------- reasons
INVALID_JSON = "invalid_json"            # a jsonl line that is not JSON
NOT_AN_OBJECT = "not_an_object"          # JSON, but not an object
MISSING_FIELD = "missing_field"          # a field the format requires is absent or null
WRONG_TYPE = "wrong_type"                # a field of the wrong type (string where a list belongs, ...)
EMPTY_CONVERSATION = "empty_conversation"  # no user turn at all
UNKNOWN_ROLE = "unknown_role"            # a role/from value the format does not define
ROLE_ORDER = "role_order"                # assistant first, system in the middle, tool result without a call, ...
EMPTY_MESSAGE = "empty_message"          # a user/system/tool turn with no text
BAD_TOOL_CALL = "bad_tool_call"          # tool call without a name, arguments that are not a JSON object
BAD_NATIVE = "bad_native"                # pre-tokenized sample with mismatched ids/mask, no loss tokens, ...
TOO_LONG = "too_long"                    # length filter (target tokens)
TOO_SHORT = "too_short"                  # length filter (target tokens)
TOKEN_OUT_OF_RANGE = "token_out_of_range"  # native ids outside the target's vocabulary
TEMPLATE_NOT_APPEND_ONLY = "template_not_append_only"  # the chat template rewrites earlier turns
ASSISTANT_RENDER_MISMATCH = "assistant_render_mismatch"  # the template renders the target's answer differently
ENGINE_ERROR = "engine_error"            # the engine failed on this sample alone
DAMAGED_SOURCE = "damaged_source"        # the file is damaged here (truncated, invalid bytes): reading stopped

REASONS = (INVALID_JSON, NOT_AN_OBJECT, MISSING_FIELD, WRONG_TYPE, EMPTY_CONVERSATION, UNKNOWN_ROLE, ROLE_ORDER,
           EMPTY_MESSAGE, BAD_TOOL_CALL, BAD_NATIVE, TOO_LONG, TOO_SHORT, TOKEN_OUT_OF_RANGE,
           TEMPLATE_NOT_APPEND_ONLY, ASSISTANT_RENDER_MISMATCH, ENGINE_ERROR, DAMAGED_SOURCE)

# What a quarantine reason points at (the quarantine alert's annotation and runbook follow this split, checked by
# tests/test_regen_sources.py): the dataset's rows, the adapter chosen for the source, the length settings, or the
# target/engine.
REASON_GROUPS = {
    "data": (INVALID_JSON, NOT_AN_OBJECT, EMPTY_CONVERSATION, EMPTY_MESSAGE, BAD_TOOL_CALL, BAD_NATIVE,
             TOKEN_OUT_OF_RANGE, DAMAGED_SOURCE),
    "adapter": (MISSING_FIELD, WRONG_TYPE, UNKNOWN_ROLE, ROLE_ORDER),
    "length": (TOO_LONG, TOO_SHORT),
    "target": (TEMPLATE_NOT_APPEND_ONLY, ASSISTANT_RENDER_MISMATCH, ENGINE_ERROR),
}

# The record's own id, first field present wins (ShareGPT/xLAM ``id``, UltraChat ``prompt_id``, LMSYS
# ``conversation_id``, SWE-smith ``instance_id``); records without one get ``<file>#<index>``.
SOURCE_ID_FIELDS = ("id", "prompt_id", "conversation_id", "instance_id", "uuid", "question_id", "sample_id")

OK = "ok"

# ----------------------------------------------------------------------------------------------------- schemas
MESSAGE_TYPE = pa.struct([
    ("role", pa.string()),
    ("content", pa.string()),
    ("reasoning_content", pa.string()),
    ("tool_calls", pa.string()),  # JSON list of {"type": "function", "function": {"name", "arguments": {...}}}
])

NORMALIZED_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("source", pa.string()),
    ("domain", pa.string()),
    ("messages", pa.list_(MESSAGE_TYPE)),
    ("tools", pa.string()),  # JSON list of tool schemas, or null
    ("native", pa.bool_()),
    ("native_input_ids", pa.list_(pa.int32())),
    ("native_loss_mask", pa.list_(pa.int8())),
    ("status", pa.string()),  # "ok" or a quarantine reason
    ("detail", pa.string()),
    ("raw", pa.string()),  # the input row as JSON (what quarantine keeps)
    ("source_id", pa.string()),  # the record's own id, or <file>#<index>
    ("leading_turns_dropped", pa.int32()),  # non-user turns before the first user turn (normalization note)
    ("empty_exchanges_dropped", pa.int32()),  # exchanges dropped for an empty user/tool turn (normalization note)
])

QUARANTINE_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("source", pa.string()),
    ("reason", pa.string()),
    ("detail", pa.string()),
    ("raw", pa.string()),
    ("source_id", pa.string()),  # added with issue #13; older quarantine files lack it (readers must not need it)
])

ROLES = ("system", "user", "assistant", "tool")


class BadRow(ValueError):
    """A row that cannot become a sample; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass
class Conversation:
    """A normalized conversation (``tool_calls`` parsed) or a native pre-tokenized sample."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    native_input_ids: list[int] | None = None
    native_loss_mask: list[int] | None = None

    @property
    def native(self) -> bool:
        return self.native_input_ids is not None


# ------------------------------------------------------------------------------------------------------ helpers
def _hash(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode("utf-8"))
        h.update(b"\x00")
    return h.hexdigest()[:32]


def _canon(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def conversation_id(conv: Conversation) -> str:
    """Stable content hash of what regeneration depends on (assistant answers excluded: the target replaces them)."""
    if conv.native:
        return _hash("native", _canon(conv.native_input_ids), _canon(conv.native_loss_mask))
    turns = [[m["role"], None if m["role"] == "assistant" else m.get("content")] for m in conv.messages]
    return _hash("conv", _canon(turns), _canon(conv.tools))


def raw_id(raw: str) -> str:
    """Id of a row that could not be normalized: a hash of its raw text (stable, so reruns find it done)."""
    return _hash("raw", raw)


def raw_json(row: Any) -> str:
    """The raw row as JSON text (what quarantine keeps)."""
    return json.dumps(row, ensure_ascii=False, default=str)


def _field(row: dict, *names: str, required: bool = True) -> Any:
    for n in names:
        if row.get(n) is not None:
            return row[n]
    if required:
        raise BadRow(MISSING_FIELD, " or ".join(repr(n) for n in names))
    return None


def _text(value: Any, where: str, *, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise BadRow(WRONG_TYPE, f"{where} must be a string, got {type(value).__name__}")
    if not allow_empty and not value.strip():
        raise BadRow(EMPTY_MESSAGE, f"{where} is empty")
    return value


def _maybe_json(value: Any, where: str) -> Any:
    """Fields that datasets store either as JSON text or as nested values (xLAM ``tools``, SWE-smith ``messages``)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise BadRow(WRONG_TYPE, f"{where} is a string but not valid JSON ({e.msg})") from None
    return value


_THINK = re.compile(r"^\s*<think>(.*?)</think>\s*(.*)$", re.S)
_OPENTHOUGHTS = re.compile(
    r"^\s*<\|begin_of_thought\|>(.*?)<\|end_of_thought\|>\s*(?:<\|begin_of_solution\|>(.*?)<\|end_of_solution\|>)?\s*(.*)$",
    re.S)


def split_reasoning(text: str) -> tuple[str | None, str]:
    """``(reasoning, answer)`` of an assistant text with ``<think>`` or OpenThoughts' thought/solution markers."""
    m = _THINK.match(text)
    if m:
        return m.group(1).strip() or None, m.group(2)
    m = _OPENTHOUGHTS.match(text)
    if m:
        answer = (m.group(2) or "").strip() + (m.group(3) or "")
        return m.group(1).strip() or None, answer.strip()
    return None, text


_TOOL_CALL_TAG = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def split_tool_calls(text: str) -> tuple[str, list[dict[str, Any]] | None]:
    """``(text without calls, calls)`` for Hermes-style ``<tool_call>{json}</tool_call>`` blocks in ShareGPT values.

    A block that is not a valid call stays in the text (it is only history; the target regenerates the turn).
    """
    calls, keep, last = [], [], 0
    for m in _TOOL_CALL_TAG.finditer(text):
        try:
            call = _tool_call(json.loads(m.group(1)), "tool_call")
        except (json.JSONDecodeError, BadRow):
            continue
        calls.append(call)
        keep.append(text[last:m.start()])
        last = m.end()
    if not calls:
        return text, None
    keep.append(text[last:])
    return "".join(keep).strip(), calls


def _tool_call(tc: Any, where: str) -> dict[str, Any]:
    """One OpenAI-style tool call (``{"function": {...}}`` or bare ``{"name", "arguments"}``) -> canonical form."""
    if not isinstance(tc, dict):
        raise BadRow(BAD_TOOL_CALL, f"{where} is not an object")
    fn = tc.get("function") if isinstance(tc.get("function"), dict) else tc
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise BadRow(BAD_TOOL_CALL, f"{where} has no function name")
    args = fn.get("arguments", fn.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise BadRow(BAD_TOOL_CALL, f"{where} ({name}) arguments are not valid JSON") from None
    if not isinstance(args, dict):
        raise BadRow(BAD_TOOL_CALL, f"{where} ({name}) arguments must be a JSON object")
    return {"type": "function", "function": {"name": name, "arguments": args}}


def _tools(value: Any, where: str = "tools") -> list[dict[str, Any]] | None:
    value = _maybe_json(value, where)
    if value is None or value == []:
        return None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise BadRow(WRONG_TYPE, f"{where} must be a list of tool objects")
    out = []
    for i, t in enumerate(value):
        fn = t.get("function") if isinstance(t.get("function"), dict) else t
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRow(BAD_TOOL_CALL, f"{where}[{i}] has no name")
        out.append({"type": "function", "function": fn})
    return out


def _msg(role: str, content: str | None, reasoning: str | None = None,
         tool_calls: list[dict] | None = None) -> dict[str, Any]:
    return {"role": role, "content": content, "reasoning_content": reasoning, "tool_calls": tool_calls or None}


@dataclass
class Repaired:
    """A conversation after the keep-what-is-usable rules, and what they removed (reported as notes, per source)."""

    messages: list[dict[str, Any]]
    leading_turns_dropped: int = 0
    empty_exchanges_dropped: int = 0


def _is_empty(m: dict[str, Any]) -> bool:
    return isinstance(m.get("content"), str) and not m["content"].strip()


def repair_conversation(messages: list[dict[str, Any]]) -> Repaired:
    """Keep what is usable, as EAGLE data pipelines do (docs/OPERATIONS.md, "Normalization rules").

    Split ShareGPT chats often start mid-exchange with a ``gpt`` turn, and dumps carry empty human turns; quarantining
    the whole conversation for either loses most of a public dump. So: an empty leading system message is dropped;
    assistant/tool turns before the first user turn are dropped; an exchange (a user turn and everything up to the
    next user turn) holding an empty user or tool turn is dropped. ``None`` content is not "empty": it stays a
    ``missing_field`` for :func:`validate_conversation`.
    """
    msgs = list(messages)
    head: list[dict[str, Any]] = []
    if msgs and msgs[0]["role"] == "system":
        first = msgs.pop(0)
        if not _is_empty(first):
            head.append(first)
    lead = 0
    while msgs and msgs[0]["role"] in ("assistant", "tool"):
        msgs.pop(0)
        lead += 1
    exchanges: list[list[dict[str, Any]]] = []
    for m in msgs:
        if m["role"] == "user" or not exchanges:
            exchanges.append([m])
        else:
            exchanges[-1].append(m)
    kept = [ex for ex in exchanges if not any(m["role"] in ("user", "tool") and _is_empty(m) for m in ex)]
    return Repaired(head + [m for ex in kept for m in ex], lead, len(exchanges) - len(kept))


def validate_conversation(messages: list[dict[str, Any]]) -> None:
    """Role order every regeneration relies on; raises :class:`BadRow` with the first problem found."""
    if not any(m["role"] == "user" for m in messages):
        raise BadRow(EMPTY_CONVERSATION, f"{len(messages)} message(s) and no user turn")
    prev = None
    for i, m in enumerate(messages):
        role = m["role"]
        if role == "system" and i != 0:
            raise BadRow(ROLE_ORDER, f"system message at position {i} (only the first message may be system)")
        if role == "assistant" and prev in (None, "system"):
            raise BadRow(ROLE_ORDER, f"assistant turn at position {i} before any user turn")
        if role == "tool" and not _follows_tool_call(messages, i):
            raise BadRow(ROLE_ORDER, f"tool result at position {i} without a preceding assistant tool call")
        if role == "assistant" and prev == "assistant":
            raise BadRow(ROLE_ORDER, f"two assistant turns in a row at position {i}")
        if role in ("user", "system", "tool"):
            if m.get("content") is None:
                raise BadRow(MISSING_FIELD, f"{role} message at position {i} has no content")
            if not m["content"].strip():
                raise BadRow(EMPTY_MESSAGE, f"{role} message at position {i} is empty")
        prev = role


def _follows_tool_call(messages: list[dict], i: int) -> bool:
    j = i - 1
    while j >= 0 and messages[j]["role"] == "tool":
        j -= 1
    return j >= 0 and messages[j]["role"] == "assistant" and bool(messages[j].get("tool_calls"))


# ------------------------------------------------------------------------------------------------------ adapters
SHAREGPT_ROLES = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
    "bard": "assistant", "bing": "assistant", "model": "assistant", "system": "system", "tool": "tool",
    "function_response": "tool", "observation": "tool", "ipython": "tool",
}


def adapt_sharegpt(row: dict) -> Conversation:
    """ShareGPT ``conversations[{from, value}]`` (+ optional top-level ``system`` as in OpenThoughts, ``tools``)."""
    turns = _maybe_json(_field(row, "conversations", "conversation", "items"), "conversations")
    if not isinstance(turns, list):
        raise BadRow(WRONG_TYPE, f"conversations must be a list, got {type(turns).__name__}")
    messages: list[dict[str, Any]] = []
    system = row.get("system")
    if system is not None and _text(system, "system", allow_empty=True).strip():
        messages.append(_msg("system", system))
    for i, t in enumerate(turns):
        if not isinstance(t, dict):
            raise BadRow(WRONG_TYPE, f"conversations[{i}] must be an object, got {type(t).__name__}")
        who = t.get("from", t.get("role"))
        if who is None:
            raise BadRow(MISSING_FIELD, f"conversations[{i}].from")
        role = SHAREGPT_ROLES.get(str(who).lower())
        if role is None:
            raise BadRow(UNKNOWN_ROLE, f"conversations[{i}].from = {who!r}")
        value = t.get("value", t.get("content"))
        if value is None:
            raise BadRow(MISSING_FIELD, f"conversations[{i}].value")
        value = _text(value, f"conversations[{i}].value", allow_empty=True)
        if role == "assistant":
            reasoning, answer = split_reasoning(value)
            answer, calls = split_tool_calls(answer)
            messages.append(_msg("assistant", answer, reasoning, calls))
        else:
            messages.append(_msg(role, value))
    return Conversation(messages, _tools(row.get("tools")))


OPENAI_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
                "tool": "tool", "function": "tool", "ipython": "tool"}


def _openai_content(value: Any, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):  # content parts
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text", "output_text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRow(WRONG_TYPE, f"{where}[{j}] is a {kind!r} content part; only text is supported")
            texts.append(_text(part.get("text"), f"{where}[{j}].text", allow_empty=True))
        return "".join(texts)
    raise BadRow(WRONG_TYPE, f"{where} must be a string or a list of text parts, got {type(value).__name__}")


def adapt_openai(row: dict) -> Conversation:
    """OpenAI chat ``messages[{role, content, reasoning_content, tool_calls}]`` (UltraChat, LMSYS, SWE-smith)."""
    turns = _maybe_json(_field(row, "messages", "conversation", "conversations"), "messages")
    if not isinstance(turns, list):
        raise BadRow(WRONG_TYPE, f"messages must be a list, got {type(turns).__name__}")
    messages: list[dict[str, Any]] = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict):
            raise BadRow(WRONG_TYPE, f"messages[{i}] must be an object, got {type(t).__name__}")
        if t.get("role") is None:
            raise BadRow(MISSING_FIELD, f"messages[{i}].role")
        role = OPENAI_ROLES.get(str(t["role"]).lower())
        if role is None:
            raise BadRow(UNKNOWN_ROLE, f"messages[{i}].role = {t['role']!r}")
        content = _openai_content(t.get("content"), f"messages[{i}].content")
        if role != "assistant":
            messages.append(_msg(role, content))
            continue
        calls = t.get("tool_calls")
        if calls is None and isinstance(t.get("function_call"), dict):
            calls = [t["function_call"]]
        calls = _maybe_json(calls, f"messages[{i}].tool_calls")
        if calls is not None and not isinstance(calls, list):
            raise BadRow(WRONG_TYPE, f"messages[{i}].tool_calls must be a list")
        tool_calls = [_tool_call(c, f"messages[{i}].tool_calls[{k}]") for k, c in enumerate(calls or [])]
        reasoning = t.get("reasoning_content", t.get("reasoning"))
        if reasoning is not None:
            reasoning = _text(reasoning, f"messages[{i}].reasoning_content", allow_empty=True) or None
        elif content:
            reasoning, content = split_reasoning(content)
        messages.append(_msg("assistant", content or "", reasoning, tool_calls))
    return Conversation(messages, _tools(row.get("tools")))


def adapt_alpaca(row: dict) -> Conversation:
    """Instruction tuning ``instruction`` (+ ``input``) -> ``output`` / ``response`` (CodeAlpaca, Magicoder)."""
    instruction = _text(_field(row, "instruction"), "instruction")
    extra = row.get("input")
    if extra is not None and _text(extra, "input", allow_empty=True).strip():
        instruction = f"{instruction}\n\n{extra}"
    output = _text(_field(row, "output", "response"), "output", allow_empty=True)
    reasoning, answer = split_reasoning(output)
    return Conversation([_msg("user", instruction), _msg("assistant", answer, reasoning)])


def adapt_problem_solution(row: dict) -> Conversation:
    """Math ``problem`` -> ``solution`` (NuminaMath); ``question``/``answer`` (GSM8K-style) also accepted."""
    problem = _text(_field(row, "problem", "question"), "problem")
    solution = _text(_field(row, "solution", "answer"), "solution", allow_empty=True)
    reasoning, answer = split_reasoning(solution)
    return Conversation([_msg("user", problem), _msg("assistant", answer, reasoning)])


def adapt_tool_use(row: dict) -> Conversation:
    """xLAM function calling: ``query``, ``tools`` (JSON text), ``answers`` (JSON text: the calls)."""
    query = _text(_field(row, "query"), "query")
    tools = _tools(_field(row, "tools"), "tools")
    if not tools:
        raise BadRow(WRONG_TYPE, "tools is empty: a tool-use sample needs at least one tool")
    answers = _maybe_json(_field(row, "answers"), "answers")
    if not isinstance(answers, list):
        raise BadRow(WRONG_TYPE, f"answers must be a list of calls, got {type(answers).__name__}")
    calls = [_tool_call(a, f"answers[{k}]") for k, a in enumerate(answers)]
    return Conversation([_msg("user", query), _msg("assistant", "", None, calls)], tools)


def adapt_native(row: dict) -> Conversation:
    """Samples already produced by the target: ``input_ids`` + ``loss_mask`` (0/1), regeneration is skipped."""
    ids = _field(row, "input_ids")
    mask = _field(row, "loss_mask")
    for name, v in (("input_ids", ids), ("loss_mask", mask)):
        if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise BadRow(WRONG_TYPE, f"{name} must be a list of integers")
    if not ids:
        raise BadRow(BAD_NATIVE, "input_ids is empty")
    if len(ids) != len(mask):
        raise BadRow(BAD_NATIVE, f"input_ids has {len(ids)} tokens but loss_mask has {len(mask)}")
    if any(x not in (0, 1) for x in mask):
        raise BadRow(BAD_NATIVE, "loss_mask values must be 0 or 1")
    if not any(mask):
        raise BadRow(BAD_NATIVE, "loss_mask has no 1s: nothing the target generated")
    if any(x < 0 for x in ids):
        raise BadRow(TOKEN_OUT_OF_RANGE, "negative token id")
    return Conversation(native_input_ids=list(ids), native_loss_mask=list(mask))


ADAPTERS: dict[str, Callable[[dict], Conversation]] = {
    "sharegpt": adapt_sharegpt,
    "openai": adapt_openai,
    "alpaca": adapt_alpaca,
    "problem_solution": adapt_problem_solution,
    "tool_use": adapt_tool_use,
    "native": adapt_native,
}


# ---------------------------------------------------------------------------------------------------- normalize
def source_id(row: Any, fallback: str | None) -> str | None:
    """The record's own id (:data:`SOURCE_ID_FIELDS`), else ``fallback`` (``<file>#<index>``)."""
    if isinstance(row, dict):
        for name in SOURCE_ID_FIELDS:
            v = row.get(name)
            if isinstance(v, (str, int)) and not isinstance(v, bool) and str(v).strip():
                return str(v)
    return fallback


def normalize_record(record: Any, adapter: str, *, source: str, domain: str,
                     fallback_id: str | None = None, where: str | None = None) -> dict[str, Any]:
    """One input record (a jsonl line as text, or a parsed row) -> a row of :data:`NORMALIZED_SCHEMA`.

    ``fallback_id`` is the ``source_id`` of a record without an id of its own; ``where`` (file and line) prefixes
    the detail of a line that is not JSON, so the operator can find it.
    """
    if isinstance(record, str):
        raw = record
        try:
            row = json.loads(record)
        except json.JSONDecodeError as e:
            at = f"{where}: " if where else ""
            return bad_row(raw, source, domain, INVALID_JSON, f"{at}line is not JSON ({e.msg} at column {e.colno})",
                        fallback_id)
    else:
        row, raw = record, raw_json(record)
    sid = source_id(row, fallback_id)
    if not isinstance(row, dict):
        return bad_row(raw, source, domain, NOT_AN_OBJECT, f"expected a JSON object, got {type(row).__name__}", sid)
    fixed = Repaired([])
    try:
        conv = ADAPTERS[adapter](row)
        if not conv.native:
            fixed = repair_conversation(conv.messages)
            conv.messages = fixed.messages
            if fixed.empty_exchanges_dropped and not any(m["role"] == "user" for m in conv.messages):
                raise BadRow(EMPTY_CONVERSATION, f"no user turn left after dropping {fixed.empty_exchanges_dropped} "
                                                 "exchange(s) with an empty turn")
            validate_conversation(conv.messages)
    except BadRow as e:
        return bad_row(raw, source, domain, e.reason, e.detail, sid)
    return {
        "id": conversation_id(conv), "source": source, "domain": domain,
        "messages": [_to_arrow_message(m) for m in conv.messages],
        "tools": None if conv.tools is None else _canon(conv.tools),
        "native": conv.native, "native_input_ids": conv.native_input_ids, "native_loss_mask": conv.native_loss_mask,
        "status": OK, "detail": None, "raw": raw, "source_id": sid,
        "leading_turns_dropped": fixed.leading_turns_dropped, "empty_exchanges_dropped": fixed.empty_exchanges_dropped,
    }


def bad_row(raw: str, source: str, domain: str, reason: str, detail: str, sid: str | None = None) -> dict[str, Any]:
    """A quarantine row of :data:`NORMALIZED_SCHEMA` (id = hash of the raw text: stable, so reruns find it done)."""
    return {"id": raw_id(raw), "source": source, "domain": domain, "messages": [], "tools": None, "native": False,
            "native_input_ids": None, "native_loss_mask": None, "status": reason, "detail": detail, "raw": raw,
            "source_id": sid, "leading_turns_dropped": 0, "empty_exchanges_dropped": 0}


def _to_arrow_message(m: dict[str, Any]) -> dict[str, Any]:
    return {"role": m["role"], "content": m.get("content"), "reasoning_content": m.get("reasoning_content"),
            "tool_calls": _canon(m["tool_calls"]) if m.get("tool_calls") else None}


def normalize_records(records: Iterable[Any], adapter: str, *, source: str, domain: str) -> pa.Table:
    """A batch of records -> a :data:`NORMALIZED_SCHEMA` table (never raises on bad data)."""
    rows = [normalize_record(r, adapter, source=source, domain=domain) for r in records]
    return pa.Table.from_pylist(rows, schema=NORMALIZED_SCHEMA)


def damage_row(source: str, domain: str, *, file: str, offset: int, message: str, records_before: int) -> dict:
    """The quarantine row of a damaged file: one per (file, offset, message), so a rerun finds it already done."""
    facts = {"file": file, "offset": offset, "message": message, "records_before": records_before}
    raw = _canon(facts)
    detail = (f"{file}: damaged at byte {offset}: {message}; the {records_before} record(s) before it were read, "
              "the rest of the file was not")
    return {"id": _hash("damage", source, file, str(offset), message), "source": source, "domain": domain,
            "messages": [], "tools": None, "native": False, "native_input_ids": None, "native_loss_mask": None,
            "status": DAMAGED_SOURCE, "detail": detail, "raw": raw, "source_id": f"{Path(file).name}@{offset}",
            "leading_turns_dropped": 0, "empty_exchanges_dropped": 0}


def template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Normalized messages -> what a chat template expects (tool calls parsed, empty optional fields left out)."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": m["role"], "content": m.get("content") or ""}
        if m.get("reasoning_content"):
            d["reasoning_content"] = m["reasoning_content"]
        calls = m.get("tool_calls")
        if calls:
            d["tool_calls"] = json.loads(calls) if isinstance(calls, str) else calls
        out.append(d)
    return out


def parse_tools(tools: str | list | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    return json.loads(tools) if isinstance(tools, str) else list(tools)


# ------------------------------------------------------------------------------------------------ length, dedup
def length_problem(num_tokens: int, min_tokens: int, max_tokens: int) -> tuple[str, str] | None:
    """The length filter: ``(reason, detail)`` for a sample outside ``[min_tokens, max_tokens]``, else None."""
    if num_tokens > max_tokens:
        return TOO_LONG, f"{num_tokens} tokens > max_tokens {max_tokens}"
    if num_tokens < min_tokens:
        return TOO_SHORT, f"{num_tokens} tokens < min_tokens {min_tokens}"
    return None


def conversation_tokens(tokenizer: Any, messages: Sequence[dict[str, Any]], tools: Any) -> int:
    """Target tokens of the conversation as given (original answers), the input side of the length filter."""
    from eaglenest.engines.base import render_chat_ids

    return len(render_chat_ids(tokenizer, template_messages(messages), tools=parse_tools(tools),
                               add_generation_prompt=messages[-1]["role"] != "assistant"))


class Deduplicator:
    """First occurrence of an id wins (sources in config order, rows in file order); later ones are counted."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.duplicates: dict[str, int] = {}

    def first(self, sample_id: str, source: str) -> bool:
        if sample_id in self.seen:
            self.duplicates[source] = self.duplicates.get(source, 0) + 1
            return False
        self.seen.add(sample_id)
        return True
