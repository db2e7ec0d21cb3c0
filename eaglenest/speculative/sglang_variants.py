"""What ``eaglenest bench`` and ``eaglenest tune`` start on SGLang for each variant they measure: the plain engine,
one static shape, or a step plan (a tuned schedule, or "off") launched exactly as serve launches it.

Kept in the core (not the CLI) because the flywheel re-tunes a promoted drafter with the same engines.
"""

from __future__ import annotations

import sys
from typing import Any


def planned_launch(spec: Any, plan: Any, extra_args: Any, expected: tuple[int, int], route: Any = None) -> Any:
    """What a bench/tune variant starts on SGLang, as the ``SGLangPlan`` serve acts on: ``spec`` None and no
    ``plan``: plain; a shape: static; a ``plan`` (a tuned schedule, or "off") as serve launches it
    (``plan.sglang_plan`` with serve's ``route`` settings, its notes to stderr). Only mode "plain" is the engine
    without a drafter: adaptive mode has no static shape."""
    from eaglenest.speculative.schedule import SGLangPlan

    if plan is None:
        return SGLangPlan("plain") if spec is None else SGLangPlan("static", spec=spec)
    routing = {"route": route.by_load, "route_limit": route.limit} if route is not None else {}
    launch = plan.sglang_plan(extra_args, expected=expected, provenance="eaglenest bench/tune", **routing)
    for note in launch.notes:
        print(f"eaglenest: {note}", file=sys.stderr)
    return launch


def sglang_factory(tc, expected: tuple[int, int] = (1, 256), serve: Any = None):
    """SGLang integration point: one checked ``SGLangEngine`` per variant (eaglenest.engines.sglang.engine).

    ``factory(spec, drafter)``: the plain engine (``spec`` None) or one static shape; ``factory(None, drafter,
    plan=...)``: a step plan (a tuned schedule, or "off") launched as serve launches it (:func:`planned_launch`).
    Each engine's start raises on a scheduler failure rather than ending the bench, so the other variants are still
    measured (``start_failure_raises``). A speculative engine runs as many requests at once as the plain one will be
    asked to (``expected[1]``, the largest batch), not SGLang's own cap of 48 for speculative launches. ``serve``
    (the serving config): a schedule routed by live load there (``serve.route``) is measured as routed
    (:class:`~eaglenest.speculative.routed_engine.RoutedEngine`)."""
    from eaglenest.engines.sglang.engine import SGLangEngine

    def factory(spec, drafter_dir, plan=None):
        launch = planned_launch(spec, plan, tc.sglang.extra_args, expected,
                                route=serve.route if serve is not None else None)
        if launch.mode == "plain":
            return SGLangEngine(tc, start_failure_raises=True)
        if launch.mode == "routed":
            from eaglenest.speculative.routed_engine import RoutedEngine, speculative_target

            fast_tc, limit = speculative_target(tc, serve, launch.route_limit), launch.route_limit
            return RoutedEngine(lambda: SGLangEngine.speculative(fast_tc, str(drafter_dir), launch.spec,
                                                                 start_failure_raises=True, concurrency=limit),
                                lambda: SGLangEngine(tc, start_failure_raises=True), limit)
        return SGLangEngine.speculative(tc, str(drafter_dir), launch.spec, adaptive=launch.adaptive,
                                        start_failure_raises=True, concurrency=expected[1])

    return factory


__all__ = ["planned_launch", "sglang_factory"]
