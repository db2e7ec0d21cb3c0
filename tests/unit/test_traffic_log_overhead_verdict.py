"""benchmarks/traffic_log_overhead.py judges the <= 2% target only when the median pair's 95% interval decides it."""

from __future__ import annotations

import importlib.util
import math
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("traffic_log_overhead", ROOT / "benchmarks" / "traffic_log_overhead.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_the_median_s_interval_is_the_sign_test_s_order_statistics():
    xs = list(range(1, 42))  # 41 pairs: the 95% interval is the 14th to the 28th value (binomial tail 0.0218)
    assert bench.median_ci([float(x) for x in xs]) == (14.0, 28.0)
    assert bench.median_ci([3.0, 1.0, 2.0]) == (-math.inf, math.inf)  # too few pairs bound nothing at 95%
    six = [float(x) for x in range(6)]
    assert bench.median_ci(six) == (0.0, 5.0)  # six pairs: the extremes (tail 1/64 <= 0.025, 7/64 is not)


def test_an_interval_within_the_target_is_met_above_it_missed_across_it_unresolved():
    assert bench.verdict((-0.5, 1.9)) == "met"
    assert bench.verdict((2.1, 5.0)) == "MISSED"
    assert bench.verdict((0.35, 3.91)).startswith("unresolved")
    assert bench.verdict((-math.inf, math.inf)).startswith("unresolved")


def test_many_noisy_pairs_resolve_what_few_cannot():
    """A true cost of 0.5% under noise of +-6 points (this machine's A/A spread): 7 pairs leave it unresolved, 201
    pairs meet the target; a true cost of 5% is MISSED with as many. So the verdict can fail either way."""
    rng = random.Random(0)
    few = [0.5 + rng.uniform(-6, 6) for _ in range(7)]
    assert bench.judged(few)["verdict"].startswith("unresolved")
    assert bench.judged([0.5 + rng.uniform(-6, 6) for _ in range(201)])["verdict"] == "met"
    assert bench.judged([5.0 + rng.uniform(-6, 6) for _ in range(201)])["verdict"] == "MISSED"


def test_the_rounds_orders_are_balanced():
    """Every side runs as often in every place of a round, and within rounds right after every other side as often
    (with the control: six orders), so neither the machine's drift nor one run's wake favours a side."""
    from collections import Counter
    from itertools import pairwise

    for n, orders in bench.ROTATIONS.items():
        assert all(sorted(o) == sorted(orders[0]) and len(o) == n for o in orders)
        places = Counter((i, side) for o in orders for i, side in enumerate(o))
        assert len(set(places.values())) == 1 and len(places) == n * n
        follows = Counter(pair for o in orders for pair in pairwise(o))
        assert len(set(follows.values())) == 1 and len(follows) == n * (n - 1)


def test_sessions_start_their_applications_in_rotating_order():
    """Across sessions every side is deployed first (second, third) equally often, so whatever a start order lends a
    replica falls on all sides alike."""
    from collections import Counter
    from types import SimpleNamespace

    specs = [SimpleNamespace(name=n) for n in ("off", "on", "ctl")]
    orders = [[s.name for s in bench.start_order(specs, k)] for k in range(6)]
    assert all(sorted(o) == ["ctl", "off", "on"] for o in orders)
    assert len(set(Counter((i, n) for o in orders for i, n in enumerate(o)).values())) == 1
    assert [s.name for s in bench.start_order(specs[:2], 1)] == ["on", "off"]


def test_across_sessions_judges_the_session_medians_not_the_pooled_pairs():
    """A replica difference of +3% in half the sessions and -1% in the other half: judged on the session medians,
    that spread leaves the cost unresolved; quiet sessions meet the target; 5 sessions bound nothing."""
    per_session = [{"throughput_cost": {"median_pct": 3.0 if k % 2 else -1.0}} for k in range(12)]
    judged_sessions = bench.across_sessions(per_session, "throughput_cost")
    assert judged_sessions["pairs"] == sorted(s["throughput_cost"]["median_pct"] for s in per_session)
    assert judged_sessions["verdict"].startswith("unresolved")
    assert bench.across_sessions(per_session[:5], "throughput_cost")["ci95_pct"] == [-math.inf, math.inf]
    quiet = [{"throughput_cost": {"median_pct": 0.2 * (k % 3)}} for k in range(12)]
    assert bench.across_sessions(quiet, "throughput_cost")["verdict"] == "met"
