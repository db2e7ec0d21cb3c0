"""``serve deploy`` entry point of the OpenAI-compatible Ray Serve application: ``eaglenest.serve.app:build_app``.

The application is split by job: :mod:`~eaglenest.serve.deployment` (Ray Serve deployment, FastAPI ingress,
``make_app``), :mod:`~eaglenest.serve.routes` (HTTP handlers), :mod:`~eaglenest.serve.core` (one replica's state:
preflight, backend, health, generation), :mod:`~eaglenest.serve.gates` (API key, model, prompt size, admission 429),
:mod:`~eaglenest.serve.sse` (event-stream framing), :mod:`~eaglenest.serve.selftest` (start-up accept-length check),
:mod:`~eaglenest.serve.drain` (graceful shutdown), :mod:`~eaglenest.serve.metrics`, :mod:`~eaglenest.serve.arrival`
(the proxy's arrival stamp, where TTFT starts) and :mod:`~eaglenest.serve.openapi_doc` (the served document).
"""

from __future__ import annotations

from typing import Any

from eaglenest.config import load_config
from eaglenest.serve.deployment import make_app


def build_app(args: dict[str, Any]) -> Any:
    """``serve deploy`` entry point: ``args = {"config": path, "drafter": path (optional)}``."""
    unknown = sorted(set(args) - {"config", "drafter"})
    if unknown:
        raise ValueError(f"unknown application args {unknown}; allowed: config, drafter")
    cfg = load_config(args.get("config"))
    return make_app(cfg, args.get("drafter"))
