"""serve: the OpenAI-compatible Ray Serve endpoint with speculative decoding, its preflight checks and metrics.

Public API (Ray Serve and torch are imported only when the app itself is used):

- ``start_serve(cfg, drafter_dir=None, *, host, port, name, route_prefix) -> base_url`` / ``stop_serve(name=None)``
- ``build_app({"config": path, "drafter": path})``: the ``serve deploy`` entry point (``eaglenest.serve.app:build_app``)
- ``run_preflight(target, drafter, algorithm=None, engine="hf") -> PreflightReport``; ``PreflightError``: the one
  preflight, ``eaglenest.drafters.preflight``, re-exported (serving runs it before any engine starts)
"""

from __future__ import annotations

from typing import Any

from eaglenest.contracts.target import TargetSpec
from eaglenest.drafters.preflight import Check, PreflightError, PreflightReport, preflight_or_raise, run_preflight
from eaglenest.serve.cli import start_serve, stop_serve


def build_app(args: dict[str, Any]) -> Any:
    """``serve deploy`` entry point (see :func:`eaglenest.serve.app.build_app`)."""
    from eaglenest.serve.app import build_app as _build

    return _build(args)


__all__ = ["Check", "PreflightError", "PreflightReport", "TargetSpec", "build_app", "preflight_or_raise",
           "run_preflight", "start_serve", "stop_serve"]
