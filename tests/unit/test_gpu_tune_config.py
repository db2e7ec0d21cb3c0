"""The GPU script's tune steps: the tune's engines capture decode graphs at the tuned batch sizes and build no prefill
graphs (fewer, shorter engine starts), and the ramp's two servers run the same engine settings, so the schedule's
engine identity, which records them, matches the server that serves it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys
sys.path.insert(0, "benchmarks")
import gpu_tune
gpu_tune.write_serve_configs()
print(json.dumps({"tune": gpu_tune.tune_config().read_text(), "serve": gpu_tune.SERVE_SCHEDULE_CONFIG.read_text(),
                  "plain": gpu_tune.SERVE_PLAIN_CONFIG.read_text()}))
"""


def _configs(tmp_path: Path, **env_extra: str) -> dict[str, dict]:
    (tmp_path / "e2e.yaml").write_text(yaml.safe_dump({
        "target": {"model": "m", "engine": "sglang", "sglang": {"extra_args": {"max_total_tokens": 4096}}},
        "serve": {"drafter": "d", "spec": {"num_steps": 3, "topk": 1, "num_draft_tokens": 4}}}))
    env = {**os.environ, "E2E_WORK": str(tmp_path), "E2E_TUNE": "1", "E2E_TUNE_BATCHES": "1,16,256", **env_extra}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return {k: yaml.safe_load(v) for k, v in json.loads(out.stdout).items()}


def test_tune_engines_capture_graphs_at_the_tuned_sizes_and_the_ramp_s_servers_match(tmp_path):
    c = _configs(tmp_path, E2E_TUNE_GRAPHS="1")
    extra = c["tune"]["target"]["sglang"]["extra_args"]
    assert extra["cuda_graph_bs_decode"] == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert extra["disable_prefill_cuda_graph"] is True and extra["max_total_tokens"] == 4096
    assert c["serve"]["target"] == c["tune"]["target"] == c["plain"]["target"], "one engine identity everywhere"
    assert c["serve"]["serve"]["schedule"] and c["plain"]["serve"]["drafter"] is None


def test_without_the_knob_the_run_s_own_engine_settings_stay(tmp_path):
    c = _configs(tmp_path, E2E_TUNE_GRAPHS="0")
    assert c["tune"]["target"]["sglang"]["extra_args"] == {"max_total_tokens": 4096}
