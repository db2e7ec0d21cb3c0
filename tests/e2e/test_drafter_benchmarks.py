"""The GPU training-step benchmark script runs end to end at toy dimensions on the CPU (so it cannot rot), with both
draft shapes and the per-kernel breakdown the GPU run uses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_train_step_benchmark_runs_on_cpu(tmp_path) -> None:
    out = tmp_path / "ts.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "train_step.py"), "--device", "cpu", "--preset", "small",
         "--seq-len", "32", "--ttt-steps", "3", "--steps", "1", "--warmup", "1", "--threads", "1",
         "--draft-shape", "both", "--profile", "--profile-steps", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["tokens_per_s"] > 0 and res["fraction_of_matmul"] > 0
    assert res["dims"]["hidden"] == 256 and res["dims"]["ttt_steps"] == 3
    assert abs(sum(res["flop_split"].values()) - 1) < 1e-9
    assert "fraction" in proc.stdout and "tokens/s" in proc.stdout
    # both draft shapes side by side (the top level describes the first, llama), each with its breakdown
    assert res["draft_shapes"] == ["llama", "mla"] and res["draft_shape"] == "llama"
    assert [r["draft_shape"] for r in res["runs"]] == ["llama", "mla"] and not res["failed"]
    assert res["shapes"]["mla"]["config"]["kv_lora_rank"] == 64
    assert res["shapes"]["mla"]["model_tflop_per_step"] != res["shapes"]["llama"]["model_tflop_per_step"]
    for run in res["runs"]:
        cats = run["profile"]["categories"]
        assert cats["matmul"]["ms"] > 0 and run["profile"]["step_ms_for_70pct"] > 0
        assert abs(sum(c["pct"] for c in cats.values()) + run["profile"]["idle_pct"] - 100) < 1e-6
    assert "per-kernel breakdown" in proc.stdout and "summary" in proc.stdout
