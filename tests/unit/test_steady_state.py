"""regen's throughput: the steady state (batches one after another, and batches in flight together on one engine) and
the whole run (first batch start to last batch end)."""

from __future__ import annotations

import pytest

from eaglenest.regen.progress import steady_state, sum_counts, whole_run


def test_batches_one_after_another_count_whole_after_the_first() -> None:
    # (start, end, pid, tokens): the first batch ends at 10; the next two run 10-20 and 20-30
    s = steady_state([(0, 10, 1, 1000), (10, 20, 1, 500), (20, 30, 1, 700)], engines=1)
    assert s["seconds"] == 20 and s["tokens"] == 1200 and s["tokens_per_second"] == 60.0
    assert s["engine_busy"] == 1.0


def test_overlapping_batches_count_only_their_tokens_inside_the_window() -> None:
    # two batches in flight: the second started with the first (at 0) and ends at 20, half of it before the window
    s = steady_state([(0, 10, 1, 1000), (0, 20, 1, 2000), (10, 30, 1, 2000)], engines=1)
    assert s["seconds"] == 20
    assert s["tokens"] == 1000 + 2000  # half of the second batch, all of the third
    assert s["tokens_per_second"] == 150.0
    assert s["engine_busy"] == 1.0  # overlap is not counted twice


def test_idle_gaps_lower_engine_busy_and_every_engine_must_finish_a_batch() -> None:
    s = steady_state([(0, 10, 1, 100), (15, 20, 1, 100), (0, 12, 2, 100), (12, 20, 2, 100)], engines=2)
    assert s["seconds"] == 8  # from the slower engine's first batch (12) to the end (20)
    assert s["engine_busy"] == pytest.approx((5 + 8) / 16, abs=1e-4)
    assert steady_state([(0, 10, 1, 100)], engines=1)["tokens"] == 0


def test_the_whole_run_counts_every_token_from_the_first_start_to_the_last_end() -> None:
    # every batch in flight at once (a short run): the steady window is what is left after the first batch ends
    batches = [(1.0, 11.0, 1, 1000), (1.2, 11.5, 1, 1000), (1.4, 12.0, 1, 1000)]
    w = whole_run(batches)
    assert w == {"seconds": 11.0, "tokens": 3000, "tokens_per_second": round(3000 / 11.0, 1)}
    assert steady_state(batches, engines=1)["seconds"] == 1.0
    assert whole_run([]) == {"seconds": 0.0, "tokens": 0, "tokens_per_second": 0.0}


def test_capture_placement_is_summed_over_engine_actors() -> None:
    assert sum_counts([{"on_arrival": 500, "at_capture": 12}, {"on_arrival": 256}]) == {"on_arrival": 756,
                                                                                          "at_capture": 12}
    assert sum_counts([]) == {}
