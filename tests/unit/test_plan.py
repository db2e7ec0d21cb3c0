"""`eaglenest plan`: the sizing arithmetic, pinned on a small config, and the CLI on the Kimi-K2.5 config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from eaglenest.cli import main as cli_main
from eaglenest.sizing import SizingInputs, SourceCount, count_source, hidden_bytes_per_token, plan

REPO = Path(__file__).resolve().parents[2]


def test_bytes_per_token_per_mode():
    assert hidden_bytes_per_token(7168, "bfloat16") == 57344  # 8*H: 3 aux states + the final one, 2 bytes each
    assert hidden_bytes_per_token(7168, "float8_e4m3fn") == 4 * 7168 + 4  # one int8 exponent per state
    assert hidden_bytes_per_token(7168, "online") == 0
    with pytest.raises(ValueError, match="allowed"):
        hidden_bytes_per_token(7168, "int4")


def test_plan_arithmetic_on_a_small_config():
    inp = SizingInputs(hidden_size=100, sources=[SourceCount("a", 3, ""), SourceCount("b", 10, "")],
                       prompt_tokens=10, answer_tokens=20, engine_tokens_per_s=50, num_engines=2,
                       gpus_per_engine=4, train_tokens_per_s=100, num_workers=1, epochs=2)
    p = plan(inp)
    assert (p["samples"], p["tokens"], p["generated_tokens"]) == (13, 390, 260)
    assert p["bytes_per_token"] == {"bfloat16": 805, "float8_e4m3fn": 409, "online": 5}
    assert p["storage_bytes"] == {"bfloat16": 390 * 805, "float8_e4m3fn": 390 * 409, "online": 390 * 5}
    assert p["engine_hours"] == pytest.approx(260 / 100 / 3600)
    # online: epoch 1 is a regen pass, epoch 2 captures the cached answers only (the assumed share of a pass)
    assert p["capture_share"] == 0.55 and p["capture_share_assumed"]
    assert p["online_engine_hours"] == pytest.approx((1 + 0.55) * 260 / 100 / 3600)
    measured = plan(SizingInputs(**{**inp.__dict__, "epochs": 4, "capture_share": 0.25, "notes": []}))
    assert not measured["capture_share_assumed"]
    assert measured["online_engine_hours"] == pytest.approx((1 + 3 * 0.25) * 260 / 100 / 3600)  # 1.75 passes
    one = plan(SizingInputs(**{**inp.__dict__, "epochs": 1, "notes": []}))
    assert one["online_engine_hours"] == pytest.approx(one["engine_hours"])  # one epoch = one regen pass
    assert p["engine_gpu_hours"] == pytest.approx(260 / 100 / 3600 * 8)
    assert p["training_hours"] == pytest.approx(390 * 2 / 100 / 3600)
    missing = plan(SizingInputs(hidden_size=100, sources=[], prompt_tokens=1, answer_tokens=1))
    assert missing["engine_hours"] is None and missing["training_hours"] is None


def test_local_sources_are_counted_and_capped(tmp_path):
    f = tmp_path / "s.jsonl"
    f.write_text("".join(json.dumps({"i": i}) + "\n" for i in range(5)) + "\n")
    assert count_source("s", str(f), 3).samples == 3
    assert count_source("s", str(f), None).samples == 5
    hub = count_source("h", None, 7)
    assert hub.samples == 7 and "hub" in hub.how


def test_plan_cli(tmp_path, capsys):
    src = tmp_path / "s.jsonl"
    src.write_text("".join(json.dumps({"conversations": []}) + "\n" for _ in range(4)))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({
        "target": {"model": "some-org/some-model"},
        "regen": {"sources": [{"name": "local", "domain": "chat", "adapter": "sharegpt", "path": str(src),
                               "max_samples": 10},
                              {"name": "hub", "domain": "chat", "adapter": "sharegpt", "hub_id": "x/y",
                               "max_samples": 6}],
                  "sampling": {"max_new_tokens": 20}, "num_actors": 2},
        "train": {"epochs": 3},
        "plan": {"prompt_tokens": 10, "engine_tokens_per_s": 50}}))
    assert cli_main(["plan", "--config", str(cfg)]) == 2  # a hub id's hidden size is not read offline
    assert "--hidden-size" in capsys.readouterr().err
    assert cli_main(["plan", "--config", str(cfg), "--hidden-size", "100"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert next(ln for ln in lines if ln.startswith("total")).split() == ["total", "10"]  # 4 counted + 6 capped
    assert next(ln for ln in lines if "bfloat16" in ln).split() == ["bfloat16", "805", "241.5", "KB"]  # 300 tokens
    assert "on 2 engine(s) at 50 generated tok/s" in out
    assert "answer-tokens" in out  # what it assumed is said
    online = next(ln for ln in lines if ln.startswith("online"))
    assert "later epochs capture the cached answers only (0.55 of a pass each)" in online
    assert "of engine wall for 3 epoch(s)" in online
    assert "capture share of a regen pass assumed 0.55" in out
    assert cli_main(["plan", "--config", str(cfg), "--hidden-size", "100", "--capture-share", "0.3"]) == 0
    out = capsys.readouterr().out
    assert "(0.30 of a pass each)" in out and "assumed 0.55" not in out
    assert cli_main(["plan", "--config", str(cfg), "--hidden-size", "100", "--capture-share", "1.5"]) == 2
    assert "--capture-share" in capsys.readouterr().err


def test_kimi_config_plans_without_a_gpu(capsys):
    assert cli_main(["plan", "--config", str(REPO / "configs/kimi-k25.yaml")]) == 0
    out = capsys.readouterr().out
    assert "83,000" in out and "9.5 TB" in out and "4.8 TB" in out  # bf16 vs fp8 for the 83K-sample plan
    assert "10.4 h wall on 4 engine(s)" in out and "333 GPU hours" in out
    assert "16.1 h of engine wall for 2 epoch(s)" in out  # online: 10.4 h x (1 + 0.55), the capture share assumed
