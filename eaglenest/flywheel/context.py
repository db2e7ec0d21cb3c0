"""What every flywheel step shares: the serving config, the ``flywheel:`` settings, the work folder with its state
and audit log, the metrics, the accept-length measurer, and where the application answers.

``state.json`` holds what must survive between turns and commands: the drafter the flywheel last put live, the one
before it (the rollback target), the traffic watermark and the turn counter. The served drafter itself is read from
the application (``GET /health``), so a drafter changed by hand is noticed.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eaglenest.config import EaglenestConfig
from eaglenest.flywheel.audit import AUDIT_FILE, AuditLog
from eaglenest.flywheel.measure import Measurer
from eaglenest.flywheel.metrics import FlywheelMetrics
from eaglenest.flywheel.settings import FlywheelConfig, flywheel_settings

STATE_FILE = "state.json"


@dataclass
class Flywheel:
    """One application's flywheel."""

    cfg: EaglenestConfig
    settings: FlywheelConfig
    workdir: Path
    url: str
    audit: AuditLog
    metrics: FlywheelMetrics
    measurer: Measurer
    state: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def create(cls, cfg: EaglenestConfig, source: str = "the config", *, serve: str | None = None) -> Flywheel:
        """``serve``: the application's base URL (``http://...``) or its Ray Serve name (default: the settings')."""
        s = flywheel_settings(cfg, source)
        if serve and not serve.startswith(("http://", "https://")):
            s = s.model_copy(update={"app": serve})
        url = serve if serve and serve.startswith(("http://", "https://")) else s.url or (
            f"http://{cfg.serve.host}:{cfg.serve.port}{s.route_prefix.rstrip('/')}")
        workdir = Path(cfg.resolve(s.workdir) or s.workdir).resolve()
        workdir.mkdir(parents=True, exist_ok=True)
        fw = cls(cfg, s, workdir, url.rstrip("/"), AuditLog(workdir / AUDIT_FILE), FlywheelMetrics.create(s.app),
                 Measurer(cfg, s.max_new_tokens))
        if (workdir / STATE_FILE).is_file():
            fw.state = json.loads((workdir / STATE_FILE).read_text())
        return fw

    def save_state(self, **changes: Any) -> None:
        self.state.update(changes)
        tmp = self.workdir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(self.state, indent=2, sort_keys=True) + "\n")
        tmp.replace(self.workdir / STATE_FILE)

    def health(self, timeout: float = 30.0) -> dict[str, Any]:
        """The application's ``GET /health`` body (503 bodies too: they still name the drafter)."""
        req = urllib.request.Request(self.url + "/health")
        key = self.cfg.serve.api_key
        if key is None:
            key = os.environ.get("EAGLENEST_API_KEY")
        if key:
            req.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - the configured server
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            return json.loads(e.read() or b"{}")

    def live_drafter(self) -> str | None:
        """The drafter folder the application serves now (None: it serves the target alone)."""
        try:
            body = self.health()
        except OSError as e:
            raise ConnectionError(f"the application at {self.url} does not answer ({e}); start it (eaglenest serve) "
                                  "or pass --serve with its URL") from e
        if "drafter" not in body:
            raise ConnectionError(f"{self.url}/health does not say which drafter it serves ({body}); it needs the "
                                  "API key (serve.api_key / EAGLENEST_API_KEY)")
        return body["drafter"]

    def live_schedule(self) -> str | None:
        """The schedule file the application serves now (None: none): what ``GET /health`` says, else (no answer)
        the one the flywheel last swapped in, else ``serve.schedule``."""
        try:
            body = self.health()
        except OSError:
            body = {}
        if "schedule" in body:  # the application says, "none" included
            return str(body["schedule"]["path"]) if body["schedule"] else None
        if "schedule" in self.state:
            return self.state["schedule"]
        return str(self.cfg.resolve(self.cfg.serve.schedule)) if self.cfg.serve.schedule else None

    def traffic_folder(self) -> Path:
        given = self.settings.traffic or self.cfg.serve.traffic_log.path
        if not given:
            raise ValueError("no traffic log: set serve.traffic_log.path (and turn the log on) or flywheel.traffic")
        return Path(self.cfg.resolve(given) or given)

    def regression_prompts(self) -> list[dict[str, Any]]:
        """The fixed regression set: ``flywheel.regression_prompts``, else ``bench.prompts`` ([] without either)."""
        from eaglenest.speculative.evaluate import load_prompts

        path = self.cfg.resolve(self.settings.regression_prompts or self.cfg.bench.prompts)
        return load_prompts(path, limit=self.settings.max_regression) if path else []


__all__ = ["STATE_FILE", "Flywheel"]
