"""The traffic log (serve.traffic_log) without Ray: what it writes, what it drops, that it never blocks, redaction,
rotation and retention, and the record contract the regen native format and the flywheel read."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from eaglenest.config import ConfigError, TrafficLogConfig, load_config
from eaglenest.contracts.traffic import FILE_GLOB, TrafficRecordError, check_record, prompt_ids, record_id
from eaglenest.regen.formats import adapt_native
from eaglenest.serve.redact import MARK, redact
from eaglenest.serve.traffic_log import TrafficLog


def chars(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)


def ids_of(text: str) -> list[int]:
    return [ord(c) for c in text]


def make_log(tmp_path: Path, decode=chars, **cfg) -> TrafficLog:
    return TrafficLog(TrafficLogConfig(path=str(tmp_path / "log"), **cfg), model="m", drafter="/d", decode=decode,
                      encode=ids_of, use_ray_metrics=False, tag="t", seed=0)


def offer(log: TrafficLog, prompt: str = "Q: hi", answer: str = "A: hello", **kw) -> bool:
    return log.offer(prompt_ids=ids_of(prompt), answer_ids=ids_of(answer), route="/v1/chat/completions",
                     sampling={"temperature": 0.0}, spec={"verify_steps": 3, "accepted_tokens": 2},
                     finish_reason="stop", arrived_at=time.time(), ttft_s=0.01, **kw)


def records(log: TrafficLog) -> list[dict]:
    return [json.loads(line) for f in sorted(log.folder.glob(FILE_GLOB)) for line in f.read_text().splitlines()]


def test_a_logged_request_is_a_native_regen_sample(tmp_path) -> None:
    log = make_log(tmp_path, sample_rate=1.0, redact=False)
    assert offer(log)
    log.close()
    (rec,) = records(log)
    check_record(rec)
    assert chars(rec["input_ids"]) == "Q: hiA: hello"
    assert rec["loss_mask"] == [0] * 5 + [1] * 8 and chars(prompt_ids(rec)) == "Q: hi"
    assert rec["id"] == record_id(rec["input_ids"], rec["loss_mask"])
    assert rec["drafter"] == "/d" and rec["spec"]["verify_steps"] == 3 and rec["finished_at"] >= rec["arrived_at"]
    native = adapt_native(rec)  # regen's native adapter reads it as is: capture only, no regeneration
    assert native.native and native.native_input_ids == rec["input_ids"]
    assert log.stats()["logged"] == 1 and log.stats()["dropped"] == {"queue_full": 0, "write_error": 0}
    assert 0 < log.stats()["writer_cpu_s"] < 1  # the writer's own CPU time: what the benchmark reports as its cost


def test_sample_rate_decides_per_request(tmp_path) -> None:
    off = make_log(tmp_path / "a", sample_rate=0.0)
    assert not any(offer(off) for _ in range(50))
    off.close()
    assert records(off) == []
    half = make_log(tmp_path / "b", sample_rate=0.5, redact=False)
    kept = sum(offer(half, answer=f"A{i}") for i in range(400))
    half.close()
    assert 150 < kept < 250 and len(records(half)) == kept


def test_a_full_queue_drops_and_counts_without_waiting(tmp_path) -> None:
    release = threading.Event()

    def slow_decode(ids: list[int]) -> str:  # the writer thread blocks here (redaction decodes)
        release.wait(30)
        return chars(ids)

    log = make_log(tmp_path, decode=slow_decode, sample_rate=1.0, queue_size=4)
    t0 = time.perf_counter()
    queued = [offer(log, answer=f"A{i}") for i in range(20)]
    elapsed = time.perf_counter() - t0
    assert elapsed < 0.5, f"offering 20 records took {elapsed:.2f} s with the writer stuck: the request path waited"
    assert 4 <= sum(queued) <= 5  # the queue's 4, plus the one the writer took before it blocked
    assert log.stats()["dropped"]["queue_full"] == 20 - sum(queued)
    release.set()
    log.close()
    assert len(records(log)) == sum(queued)


def test_a_failing_write_is_counted_and_never_raises(tmp_path) -> None:
    def broken(ids: list[int]) -> str:
        raise RuntimeError("tokenizer gone")

    log = make_log(tmp_path, decode=broken, sample_rate=1.0)
    assert offer(log)
    log.close()
    assert log.stats()["dropped"]["write_error"] == 1 and records(log) == []


def test_redaction_keeps_clean_records_exact_and_retokenizes_the_others(tmp_path) -> None:
    log = make_log(tmp_path, sample_rate=1.0)
    offer(log, prompt="What is 12 times 7?", answer="12 times 7 is 84.")
    offer(log, prompt="Mail bob@example.com please", answer="Call +1 (555) 123-4567 now")
    log.close()
    clean, dirty = records(log)
    assert clean["redacted"] == 0 and chars(clean["input_ids"]) == "What is 12 times 7?12 times 7 is 84."
    assert dirty["redacted"] == 2
    text = chars(dirty["input_ids"])
    assert "bob@example.com" not in text and "555" not in text and text.count(MARK) == 2
    assert chars(prompt_ids(dirty)) == f"Mail {MARK} please"


@pytest.mark.parametrize("text", ["alice.smith+x@mail.example.org", "+44 20 7946 0958", "(555) 123-4567",
                                  "4111 1111 1111 1111", "10.0.12.7", "sk-abcdefghijklmnopqrstu",
                                  "AKIAABCDEFGHIJKLMNOP", "Bearer abcdefghijklmnopqrstuvwxyz012345"])
def test_redact_matches(text: str) -> None:
    out, n = redact(f"before {text} after")
    assert n == 1 and out == f"before {MARK} after"


@pytest.mark.parametrize("text", ["What is 24 times 32? 768.", "Count from 2 in steps of 5: 2, 7, 12, 17, 22.",
                                  "def add_2(a, x):\n    return a + x + 2", "version 1.2.3 on 2024-05-01",
                                  "The weather in rome is 21 degrees."])
def test_redact_leaves_ordinary_text(text: str) -> None:
    assert redact(text) == (text, 0)


FRAGMENTS = ["a", " ", "-", ".", "@", "(", ")", "+", "_", "\n", "7", "12", "555", "0958", "255", "10.0", "x@y.io",
             "sk-", "AKIA", "ghp_", "xoxb-", "Bearer ", "bEaReR\t", "abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOP",
             "4111 1111", "-1111-", "(555) ", "+44 ", "[redacted]", "light", "2024-05-01",
             "12 345 678", "1.2.3.4", "1 2 3 4 5 6 7 8 9 0 1 2 3"]  # each pattern's shortest shapes too


def test_redact_prefilter_changes_nothing() -> None:
    """The cheap tests in NEEDS only skip scans that could not match: on random texts made of the patterns' parts,
    redact() equals every pattern scanning every text (a wrong NEEDS entry, e.g. a literal a match need not
    contain, shows up here as a missed redaction)."""
    import random

    def unfiltered(text: str) -> tuple[str, int]:
        return redact(text, prefilter=False)

    rng = random.Random(0)
    texts = ["".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 40))) for _ in range(5000)]
    assert sum(unfiltered(t)[1] > 0 for t in texts) > 1000  # the texts do exercise the patterns
    assert [redact(t) for t in texts] == [unfiltered(t) for t in texts]


def test_rotation_keeps_the_folder_within_its_budget(tmp_path) -> None:
    log = make_log(tmp_path, sample_rate=1.0, redact=False, max_bytes=8192)
    for i in range(200):
        offer(log, answer=f"answer number {i:04d} " * 3)
    log.close()
    files = sorted(log.folder.glob(FILE_GLOB))
    total = sum(f.stat().st_size for f in files)
    assert len(files) > 1 and total <= 8192 + log.rotate_bytes
    kept = records(log)
    assert chars(kept[-1]["input_ids"]).endswith("answer number 0199 ")  # the newest stay, the oldest went
    assert len(kept) < 200


def test_files_past_retention_are_deleted(tmp_path) -> None:
    folder = tmp_path / "log"
    folder.mkdir()
    old = folder / "traffic-other-1.jsonl"
    old.write_text("{}\n")
    past = time.time() - 40 * 86400
    os.utime(old, (past, past))
    log = make_log(tmp_path, sample_rate=1.0, retention_days=30)
    offer(log)
    log.close()
    assert not old.exists() and len(records(log)) == 1


def test_an_unwritable_folder_is_refused_with_the_fix(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OSError, match="traffic_log.path .* cannot be created .* writable folder or unset it"):
        TrafficLog(TrafficLogConfig(path=str(blocker / "log")), model="m", drafter=None, decode=chars,
                   encode=ids_of, use_ray_metrics=False)


def test_config_refuses_bad_values_naming_the_key(tmp_path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("serve:\n  traffic_log: {path: x, sample_rate: 1.5}\n")
    with pytest.raises(ConfigError, match=r"serve\.traffic_log\.sample_rate"):
        load_config(f)
    f.write_text("serve:\n  traffic_log: {path: x, keep: 3}\n")
    with pytest.raises(ConfigError, match=r"serve\.traffic_log\.keep: unknown key; allowed here: max_bytes"):
        load_config(f)
    assert load_config(None).serve.traffic_log.path is None  # off by default


@pytest.mark.parametrize("bad, message", [
    ([1, 2], "a traffic record is a JSON object"),
    ({"schema": "eaglenest-traffic/1"}, "lacks"),
    ({"schema": "other/9", "id": "x", "input_ids": [1], "loss_mask": [1], "finished_at": 1}, "schema"),
    ({"schema": "eaglenest-traffic/1", "id": "x", "input_ids": [1, 2], "loss_mask": [0, 0], "finished_at": 1},
     "no 1s"),
])
def test_check_record_names_the_problem(bad, message) -> None:
    with pytest.raises(TrafficRecordError, match=message):
        check_record(bad)
