"""The traffic log's record: what serve writes for a sampled request and what regen and the flywheel read back.

One JSON object per line in ``traffic-*.jsonl`` files. It is a regen source in the native format
(``regen/formats/native.py``: ``input_ids`` + ``loss_mask``, regeneration skipped): speculative decoding is
lossless, so what the server returned is the target's own answer at the request's sampling settings and only needs
capturing. ``input_ids`` are the exact ids the target saw and produced: the prompt as the chat template rendered it
(earlier turns, tool calls and tool results included) followed by the generated answer, tool-call markers and all.
``loss_mask`` is 1 over the generated answer only: earlier assistant turns come back from the client as text and are
re-rendered, so they are not verifiably the target's tokens.

The other fields say where the record came from (route, sampling, drafter, spec statistics, timestamps); readers
must tolerate fields they do not know (a later writer may add some) and must not need the optional ones.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

SCHEMA = "eaglenest-traffic/1"
FILE_PREFIX = "traffic-"
FILE_SUFFIX = ".jsonl"
FILE_GLOB = f"{FILE_PREFIX}*{FILE_SUFFIX}"
REQUIRED = ("schema", "id", "input_ids", "loss_mask", "finished_at")


class TrafficRecordError(ValueError):
    """A traffic record that cannot be used for training; the message names the field."""


def record_id(input_ids: Sequence[int], loss_mask: Sequence[int]) -> str:
    """Content hash of a sample (the same prompt and answer served twice is one sample)."""
    h = hashlib.sha256(json.dumps([list(input_ids), list(loss_mask)], separators=(",", ":")).encode())
    return h.hexdigest()[:32]


def traffic_record(*, prompt_ids: Sequence[int], answer_ids: Sequence[int], route: str, model: str,
                   drafter: str | None, sampling: Mapping[str, Any], spec: Mapping[str, Any], finish_reason: str,
                   arrived_at: float, finished_at: float, ttft_s: float | None, request_id: str | None = None,
                   redacted: int = 0) -> dict[str, Any]:
    """The record of one served request (``arrived_at`` / ``finished_at``: Unix seconds)."""
    ids = [int(t) for t in prompt_ids] + [int(t) for t in answer_ids]
    mask = [0] * len(prompt_ids) + [1] * len(answer_ids)
    return {
        "schema": SCHEMA, "id": record_id(ids, mask), "request_id": request_id,
        "input_ids": ids, "loss_mask": mask,
        "prompt_tokens": len(prompt_ids), "completion_tokens": len(answer_ids),
        "route": route, "model": model, "drafter": drafter, "finish_reason": finish_reason,
        "sampling": dict(sampling), "spec": dict(spec),
        "arrived_at": round(float(arrived_at), 3), "finished_at": round(float(finished_at), 3),
        "ttft_s": None if ttft_s is None else round(float(ttft_s), 4), "redacted": int(redacted),
    }


def check_record(rec: Any) -> dict[str, Any]:
    """``rec`` if it is a usable record, else :class:`TrafficRecordError` naming what is wrong."""
    if not isinstance(rec, dict):
        raise TrafficRecordError(f"a traffic record is a JSON object, got {type(rec).__name__}")
    missing = [k for k in REQUIRED if k not in rec]
    if missing:
        raise TrafficRecordError(f"traffic record lacks {missing} (written by another tool, or truncated)")
    if rec["schema"] != SCHEMA:
        raise TrafficRecordError(f"traffic record schema {rec['schema']!r}; this eaglenest reads {SCHEMA!r}")
    ids, mask = rec["input_ids"], rec["loss_mask"]
    if not isinstance(ids, list) or not isinstance(mask, list) or len(ids) != len(mask):
        raise TrafficRecordError("input_ids and loss_mask must be lists of the same length")
    if not any(mask):
        raise TrafficRecordError("loss_mask has no 1s: the record holds no generated answer")
    return rec


def prompt_ids(rec: Mapping[str, Any]) -> list[int]:
    """The prompt of a record: the ids before its first loss-masked (generated) token."""
    mask = rec["loss_mask"]
    first = next((i for i, m in enumerate(mask) if m), len(mask))
    return [int(t) for t in rec["input_ids"][:first]]


def as_prompt(rec: Mapping[str, Any], domain: str = "traffic") -> dict[str, Any]:
    """The record as an evaluation prompt (``speculative.evaluate``'s ``input_ids`` form), with its sampling."""
    return {"input_ids": prompt_ids(rec), "domain": domain, "id": rec.get("id"),
            "max_tokens": rec.get("completion_tokens")}


__all__ = ["FILE_GLOB", "FILE_PREFIX", "FILE_SUFFIX", "REQUIRED", "SCHEMA", "TrafficRecordError", "as_prompt",
           "check_record", "prompt_ids", "record_id", "traffic_record"]
