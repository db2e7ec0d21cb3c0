"""The Ray Serve deployment: the FastAPI ingress whose routes delegate to :class:`~eaglenest.serve.routes.Routes`,
one :class:`~eaglenest.serve.core.ServerCore` per replica, and the bound application (``make_app``).

On SIGTERM / ``stop_serve`` the replica drains (serve.drain). ``eaglenest.serve.app:build_app`` is the
``serve deploy`` entry point; ``start_serve`` / ``stop_serve`` (serve.cli) run :func:`make_app` from Python.
"""

# no `from __future__ import annotations` here: Ray Serve's class-based FastAPI views read the route signatures at
# runtime, and string annotations would turn `request: Request` into a required query parameter.
import logging
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse, Response
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from eaglenest.config import EaglenestConfig
from eaglenest.serve import openapi_doc
from eaglenest.serve.core import ServerCore
from eaglenest.serve.drain import DEPLOYMENT_NAME, DrainWatcher
from eaglenest.serve.gates import resolve_api_key
from eaglenest.serve.openai_protocol import APIError, error_body
from eaglenest.serve.routes import (
    CHAT_ROUTE,
    COMPLETIONS_ROUTE,
    HEALTH_ROUTE,
    METRICS_ROUTE,
    MODEL_ROUTE,
    MODELS_ROUTE,
    RESPONSES_ROUTE,
    Routes,
)

OPENAPI_ROUTE = "/openapi.json"


# ----------------------------------------------------------------------------------------------- FastAPI app
api = FastAPI(title="eaglenest", description="OpenAI-compatible API with EAGLE-3 speculative decoding",
              docs_url=None, redoc_url=None, openapi_url=None)  # served by the replica: behind the API key if set


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    """Unknown routes and wrong methods get OpenAI-style bodies too; a 405 keeps Starlette's ``Allow`` header."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    msg = (f"no route {request.method} {request.url.path}; this server has POST {CHAT_ROUTE}, POST "
           f"{COMPLETIONS_ROUTE}, POST {RESPONSES_ROUTE}, GET {MODELS_ROUTE}, GET {MODEL_ROUTE}, GET {HEALTH_ROUTE}, "
           f"GET {METRICS_ROUTE}") \
        if exc.status_code in (404, 405) else str(exc.detail)
    _shared_metrics_request("other", exc.status_code)
    return JSONResponse(error_body(exc.status_code, msg, code=code), status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))


@api.exception_handler(Exception)
async def _unexpected(request: Request, exc: Exception) -> Response:
    """A bug must still answer with an OpenAI error body (clients parse it), never a plain-text 500."""
    logging.getLogger("eaglenest.serve").exception("unhandled error on %s %s", request.method, request.url.path)
    _shared_metrics_request("other", 500)
    return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}", code="internal_error"),
                        status_code=500)


def _openapi() -> dict[str, Any]:
    """The whole contract, built once (serve.openapi_doc): FastAPI alone cannot see the bodies the handlers parse
    themselves nor the streams and errors they answer with."""
    if not api.openapi_schema:
        api.openapi_schema = openapi_doc.build(api, {
            "chat": CHAT_ROUTE, "completions": COMPLETIONS_ROUTE, "responses": RESPONSES_ROUTE, "models": MODELS_ROUTE,
            "model": MODELS_ROUTE + "/{model_id}", "health": HEALTH_ROUTE, "metrics": METRICS_ROUTE})
    return api.openapi_schema


api.openapi = _openapi  # type: ignore[method-assign]

_CORE: ServerCore | None = None


def _shared_metrics_request(route: str, status: int) -> None:
    if _CORE is not None:
        _CORE.metrics.request(route, status)


DEFAULT_DEPLOYMENT_OPTIONS: dict[str, Any] = {
    "graceful_shutdown_timeout_s": 35.0,  # serve.drain_timeout_s + 5 (deployment_options follows the config)
    "graceful_shutdown_wait_loop_s": 1.0,
    "health_check_period_s": 10.0,
    "health_check_timeout_s": 30.0,
    "max_constructor_retry_count": 2,
}


@serve.deployment(name=DEPLOYMENT_NAME, **DEFAULT_DEPLOYMENT_OPTIONS)
@serve.ingress(api)
class EaglenestDeployment:
    """One replica: a ServerCore behind the FastAPI routes."""

    def __init__(self, config: dict[str, Any], drafter: str | None = None, api_key: str | None = None,
                 speculative_engine: Any = None, plain_engine: Any = None) -> None:
        """``speculative_engine`` / ``plain_engine``: handles to the engine deployments of
        ``serve.route.placement: deployments`` (serve.engine_deployment); otherwise the replica runs its engines."""
        global _CORE
        logging.basicConfig(level=logging.INFO)
        cfg = EaglenestConfig.model_validate(config)
        engines = ({"speculative": speculative_engine, "plain": plain_engine}
                   if speculative_engine is not None and plain_engine is not None else None)
        self.core = ServerCore(cfg, drafter, api_key=api_key, engines=engines)
        self.routes = Routes(self.core)
        _CORE = self.core
        ctx = serve.get_replica_context()
        self.core.spec_counters.app = ctx.app_name  # one counter store per application, shared by its replicas
        self.core.live_stats.app = ctx.app_name
        rid = f"{ctx.app_name}#{ctx.replica_id.unique_id}"
        self.drain_watcher = DrainWatcher(rid, self.core.begin_drain, lambda: self.core.inflight,
                                          self.core.drain).start()

    @api.post(CHAT_ROUTE)
    async def chat_completions(self, request: Request) -> Response:
        return await self.routes.chat(request)

    @api.post(COMPLETIONS_ROUTE)
    async def completions(self, request: Request) -> Response:
        return await self.routes.completions(request)

    @api.post(RESPONSES_ROUTE)
    async def responses(self, request: Request) -> Response:
        return await self.routes.responses(request)

    @api.get(MODELS_ROUTE)
    async def models(self, request: Request) -> Response:
        return self.routes.models(request)

    @api.get(MODELS_ROUTE + "/{model_id:path}")
    async def model(self, request: Request, model_id: str) -> Response:
        return self.routes.model(request, model_id)

    @api.get(HEALTH_ROUTE)
    async def health(self, request: Request) -> Response:
        return self.routes.health(request)

    @api.get(OPENAPI_ROUTE, include_in_schema=False)
    async def openapi(self, request: Request) -> Response:
        """The schema, and the docs below, need the API key when one is set (they describe the whole server),
        unless ``serve.docs_public``."""
        if not self._docs_allowed(request):
            return self.routes.error("other", APIError(401, "Missing or incorrect API key", code="invalid_api_key"))
        return JSONResponse(api.openapi())

    @api.get("/docs", include_in_schema=False)
    async def docs(self, request: Request) -> Response:
        if not self._docs_allowed(request):
            return self.routes.error("other", APIError(401, "Missing or incorrect API key", code="invalid_api_key"))
        return get_swagger_ui_html(openapi_url=OPENAPI_ROUTE.lstrip("/"), title="eaglenest")

    def _docs_allowed(self, request: Request) -> bool:
        return self.core.cfg.serve.docs_public or self.core.authorized(request)

    @api.get(METRICS_ROUTE)
    async def metrics(self) -> Response:
        return await self.routes.metrics()

    def check_health(self) -> None:
        """Ray Serve's probe: only a dead decoder restarts the replica (a failed self-test is reported, not looped)."""
        if not self.core.backend.alive and not self.core.shutting_down:
            raise RuntimeError(f"decoder thread is not running: {self.core.backend.fatal}")

    def __del__(self) -> None:
        """Serve's own shutdown (``serve shutdown``, a redeploy) ends here after waiting for running requests."""
        watcher = getattr(self, "drain_watcher", None)
        if watcher is not None:
            watcher.stop()
        core = getattr(self, "core", None)
        if core is not None:
            core.shutdown()


# ------------------------------------------------------------------------------------------------- building
def deployment_options(cfg: EaglenestConfig) -> dict[str, Any]:
    """Replicas, autoscaling, resources and request limits from ``serve:``."""
    s = cfg.serve
    opts: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": s.num_cpus_per_replica, "num_gpus": s.num_gpus_per_replica},
        # Serve's own shutdown waits this long for running requests before it kills the replica
        "graceful_shutdown_timeout_s": s.drain_timeout_s + 5.0,
        # a little headroom over our own limit so excess requests reach the replica and get a clear 429
        "max_ongoing_requests": s.max_concurrent_requests + max(4, s.max_concurrent_requests // 8),
    }
    if s.autoscaling:  # Serve refuses num_replicas next to autoscaling_config
        opts["autoscaling_config"] = dict(s.autoscaling)
    else:
        opts["num_replicas"] = s.num_replicas
    return opts


def resolve_drafter(cfg: EaglenestConfig, drafter: str | None) -> str | None:
    """The drafter folder: the explicit argument, else ``serve.drafter`` (relative to the config file)."""
    path = drafter or cfg.resolve(cfg.serve.drafter)
    if path is None:
        return None
    p = Path(path).expanduser().resolve()
    if not p.is_dir():
        raise FileNotFoundError(f"drafter folder {p} does not exist; export one with `eaglenest export` or pass "
                                f"--drafter DIR")
    return str(p)


def make_app(cfg: EaglenestConfig, drafter: str | None = None, *, check: bool = True,
             options: dict[str, Any] | None = None) -> Any:
    """The bound Serve application; the preflight runs here first when the target is a local folder. ``options``
    override :func:`deployment_options` (the flywheel's swap: ``max_surge_percent``)."""
    drafter = resolve_drafter(cfg, drafter)
    if check and drafter is not None:
        from eaglenest.drafters.preflight import preflight_for_config
        from eaglenest.engines.location import local_target_folder

        folder = local_target_folder(cfg)
        if folder is not None:  # remote targets are checked by the replica once loaded
            preflight_for_config(cfg, drafter, folder=folder).raise_for_failures()
    if check:  # a stale schedule is refused before anything is deployed (the replica checks again)
        from eaglenest.serve.schedule import prepare_schedule

        prepare_schedule(cfg, drafter, driver=True)
    api_key = resolve_api_key(cfg.serve.api_key)
    opts = {**deployment_options(cfg), **(options or {})}
    from eaglenest.serve.engine_deployment import bind_engines

    engines = bind_engines(cfg, drafter, surge_percent=opts.get("max_surge_percent"))
    if engines is not None:  # the engines hold the GPUs; the ingress only routes (and renders, counts, streams)
        opts["ray_actor_options"] = {**opts["ray_actor_options"], "num_gpus": 0}
        return EaglenestDeployment.options(**opts).bind(cfg.model_dump(), drafter, api_key, **engines)
    return EaglenestDeployment.options(**opts).bind(cfg.model_dump(), drafter, api_key)
