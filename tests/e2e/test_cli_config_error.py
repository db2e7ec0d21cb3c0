"""The CLI, run as its own process, turns a bad config into exit status 2 and a message naming the file and key.

(Moved from tests/unit/test_config.py: it starts a Python process, so it belongs to the e2e tier.)"""

from __future__ import annotations

import subprocess
import sys


def test_cli_reports_config_error(tmp_path):
    p = tmp_path / "cfg.yaml"
    p.write_text("target:\n  engine: vllm\n")
    proc = subprocess.run([sys.executable, "-m", "eaglenest.cli", "capture", "--config", str(p)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "target.engine" in proc.stderr and str(p) in proc.stderr
