"""Accept length on the prompt suites with the tiny target: MT-Bench's second turn is asked after the target's own
answer to the first, the per-suite table agrees with ``evaluate_acceptance`` on the same single-turn prompts, and
``eaglenest eval --suite`` / ``eaglenest bench --suite`` run on the installed packages' real files."""

from __future__ import annotations

import json

import pytest

from eaglenest.cli import main as cli_main
from eaglenest.config import SpecConfig
from eaglenest.engines.base import SamplingParams
from eaglenest.speculative.suite_eval import evaluate_suite, run_turns
from eaglenest.speculative.suites import load_suite

SPEC = SpecConfig(num_steps=3, topk=1, num_draft_tokens=4)
SAMPLING = SamplingParams(temperature=0.0, max_new_tokens=24)


@pytest.fixture(scope="module")
def drafter(tiny_engine):
    """A briefly trained drafter (~10 s on an idle box): some draft tokens accepted, so the counts compared below
    are not all 0."""
    from eaglenest.drafter.spec_fit import FitConfig, chat_prompt_answer, fit_drafter
    from eaglenest.engines.tiny import corpus_chats

    samples = chat_prompt_answer(tiny_engine, corpus_chats()[:32], regenerate=True, max_new_tokens=32, batch_size=32)
    return fit_drafter(tiny_engine, samples, FitConfig(steps=30, batch_size=12, ttt_steps=3, learning_rate=3e-3,
                                                       draft_vocab_size=256)).drafter


def test_second_turn_follows_the_targets_own_first_answer(tiny_engine, drafter) -> None:
    from eaglenest.speculative.decoder import SpecDecoder

    records, _ = load_suite("mt-bench", 2)
    dec = SpecDecoder.from_engine(tiny_engine, drafter, SPEC)
    seen: list[tuple[int, list[dict]]] = []

    def answer(convs, recs, turn):
        seen.extend((turn, c) for c in convs)
        return dec.generate([tiny_engine.render_prompt(c) for c in convs], SAMPLING)

    run_turns(records, answer)
    assert [t for t, _ in seen] == [1, 1, 2, 2]
    target_first = tiny_engine.generate([r["messages"] for r in records], SAMPLING)  # the target alone, greedy
    for (_, conv), rec, first in zip(seen[2:], records, target_first, strict=True):
        assert conv == [*rec["messages"], {"role": "assistant", "content": first.text},
                        {"role": "user", "content": rec["followups"][0]}]


def test_suite_table_agrees_with_evaluate_acceptance(tiny_engine, drafter) -> None:
    from eaglenest.speculative.evaluate import evaluate_acceptance

    records, _ = load_suite("humaneval", 6)
    report = evaluate_suite(tiny_engine, drafter, records, SPEC, sampling=SAMPLING)
    ref = evaluate_acceptance(tiny_engine, drafter, records, SPEC, sampling=SAMPLING)
    assert (report["verify_steps"], report["accepted_tokens"]) == (ref["verify_steps"], ref["accepted_tokens"])
    assert report["accepted_tokens"] > 0
    assert report["per_position"] == ref["per_position"]
    mt = evaluate_suite(tiny_engine, drafter, load_suite("mt-bench", 4)[0], SPEC, sampling=SAMPLING)
    assert set(mt["per_turn"]) == {"turn 1", "turn 2"} and mt["requests"] == 8
    assert len(mt["per_category"]) == 4 and sum(r["requests"] for r in mt["per_category"].values()) == 8
    assert sum(r["verify_steps"] for r in mt["per_turn"].values()) == mt["verify_steps"]


def test_prompts_past_the_context_are_skipped_and_counted(tiny_engine, drafter) -> None:
    long = {"suite": "x", "id": "x/0", "domain": "long", "followups": [],
            "messages": [{"role": "user", "content": "count " * 3000}]}
    short = {**long, "id": "x/1", "domain": "short", "messages": [{"role": "user", "content": "What is 2 plus 3?"}]}
    report = evaluate_suite(tiny_engine, drafter, [long, short], SPEC, sampling=SAMPLING)
    assert report["skipped_too_long"] == {"long": 1} and report["requests"] == 1


def test_eval_and_bench_cli_with_suites(tmp_path, tiny_target_path, drafter, capsys) -> None:
    from eaglenest.drafter.export import export_drafter

    folder = export_drafter(drafter, tmp_path / "d", dtype="float32")
    out = tmp_path / "suites"
    assert cli_main(["eval", "--target", str(tiny_target_path), "--drafter", str(folder), "--suite",
                     "mt-bench,humaneval,bfcl", "--num-prompts", "3", "--max-new-tokens", "16", "--dtype", "float32",
                     "--output", str(out)]) == 0
    doc = json.loads((out / "suites.json").read_text())
    assert list(doc["suites"]) == ["mt-bench", "humaneval", "bfcl"]
    assert doc["suites"]["mt-bench"]["requests"] == 6 and doc["suites"]["mt-bench"]["source"]["version"] == "26.3"
    assert (out / "suites.png").stat().st_size > 10_000
    md = (out / "suites.md").read_text()
    assert "| mt-bench | turn 2 | 3 |" in md and "| bfcl | all | 3 |" in md
    assert "| suite | category | requests | accept length | >= 1 | >= 2 | >= 3 |" in capsys.readouterr().out
    assert cli_main(["eval", "--target", str(tiny_target_path), "--drafter", str(folder), "--suite", "gsm8k"]) == 2
    assert "unknown suite 'gsm8k'" in capsys.readouterr().err
    assert cli_main(["bench", "--target", str(tiny_target_path), "--drafter", str(folder), "--suite", "mt-bench",
                     "--num-prompts", "2", "--max-new-tokens", "8", "--sweep", "3-1-4", "--repeats", "1",
                     "--dtype", "float32", "--output", str(tmp_path / "bench")]) == 0
    bench = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert bench["num_prompts"] == 4  # 2 questions x 2 turns, the second after the target's answer
