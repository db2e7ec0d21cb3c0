"""serve: the OpenAI-compatible Ray Serve endpoint with speculative decoding, its preflight checks and metrics.

Public API (Ray Serve and torch are imported only when the app itself is used):

- ``start_serve(cfg, drafter_dir=None, *, host, port, name, route_prefix) -> base_url`` / ``stop_serve(name=None)``
- ``build_app({"config": path, "drafter": path})``: the ``serve deploy`` entry point (``eaglenest.serve.app:build_app``)
- ``run_preflight(target, drafter, algorithm=None, engine="hf") -> PreflightReport``; ``PreflightError``: the one
  preflight, ``eaglenest.drafters.preflight``, re-exported (serving runs it before any engine starts)
- ``redeploy_drafter(cfg, drafter, *, app, route_prefix, surge_percent)``: swap a running application's drafter with
  no failed request (``eaglenest.serve.swap``); ``read_live_stats(app)``: its served accept length per drafter
  (``eaglenest.serve.live_stats``); both need Ray attached
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


def redeploy_drafter(cfg: Any, drafter: str | None, **kwargs: Any) -> dict[str, Any]:
    """Swap a running application's drafter (see :func:`eaglenest.serve.swap.redeploy_drafter`)."""
    from eaglenest.serve.swap import redeploy_drafter as _redeploy

    return _redeploy(cfg, drafter, **kwargs)


def read_live_stats(app: str, **kwargs: Any) -> dict[str, dict[str, Any]]:
    """Served accept length per drafter of ``app`` (see :func:`eaglenest.serve.live_stats.read_live_stats`)."""
    from eaglenest.serve.live_stats import read_live_stats as _read

    return _read(app, **kwargs)


__all__ = ["Check", "PreflightError", "PreflightReport", "TargetSpec", "build_app", "preflight_or_raise",
           "read_live_stats", "redeploy_drafter", "run_preflight", "start_serve", "stop_serve"]
