"""benchmarks/traffic_log_overhead.py judges the <= 2% target only when its side-by-side pairs can resolve it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("traffic_log_overhead", ROOT / "benchmarks" / "traffic_log_overhead.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_tight_pairs_are_judged_against_the_target():
    tight = [0.5, 1.0, 1.2, 1.5, 2.5]
    assert bench.pairs_iqr(tight) < 2 * bench.TARGET_PCT
    assert bench.verdict(1.2, bench.pairs_iqr(tight)) == "met"
    assert bench.verdict(3.0, bench.pairs_iqr(tight)) == "MISSED"


def test_pairs_wider_than_the_target_are_unresolved_whatever_the_median():
    # a run measured on the shared 2-core machine (BENCHMARKS.md): identical runs differed up to 4x
    noisy = sorted([-151.5, -112.7, -80.1, -43.6, -25.3, -10.1, -9.0, -7.6, 31.0, 47.3, 57.0])
    assert bench.verdict(-10.1, bench.pairs_iqr(noisy)).startswith("unresolved")
    assert bench.verdict(15.0, bench.pairs_iqr(noisy)).startswith("unresolved")
    assert bench.verdict(0.0, bench.pairs_iqr([1.0])).startswith("unresolved")  # one pair has no spread to read
