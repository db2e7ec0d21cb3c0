"""The flywheel closes on the tiny target (issue #31's CPU acceptance), on a real local Ray and Ray Serve over HTTP.

The live drafter was trained on arithmetic and counting only; the server, with its traffic log on, answers a domain it
never saw (the corpus' "Tell me about <name> in <city>" stories). Then, in order:
1. ``eaglenest promote`` refuses an untrained candidate (exit 1, nothing swapped, the numbers in the audit log);
2. ``eaglenest flywheel --once`` captures the logged traffic (no regeneration), retrains from the live drafter over
   traffic + the original data, picks a checkpoint by held-out accept length, passes the gate and swaps it in while
   a client streams through the swap: zero errors, every answer equal to the target's own greedy answer;
3. a candidate that passes the gate but whose weights break on the way to the server (as a failed weight sync would)
   collapses live accept length after the swap and is rolled back automatically, with an alert on a webhook.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import httpx
import openai
import pytest
import yaml
from serve_helpers import StreamingClient

from eaglenest.engines.base import SamplingParams
from eaglenest.engines.tiny import corpus_chats
from eaglenest.serve.chat_parsing import ChatFormat

APP = "flywheel"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _first_exchange(chat: dict) -> dict:
    msgs = chat["messages"]
    end = next(i for i, m in enumerate(msgs) if m["role"] == "assistant")
    return {"messages": msgs[:end + 1]}


def _prompt(chat: dict) -> list[dict]:
    """The messages before the first answer (a system message, if any, and the first user turn)."""
    return _first_exchange(chat)["messages"][:-1]


def _by_domain() -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for chat in corpus_chats():
        if "tools" in chat:
            continue
        first = next(m["content"] for m in chat["messages"] if m["role"] == "user")
        key = "story" if first.startswith("Tell me") else "math" if first.startswith("What is") else \
            "count" if first.startswith("Count") else "code"
        out.setdefault(key, []).append(chat)
    return out


class _Webhook(BaseHTTPRequestHandler):
    received: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        _Webhook.received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def world(ray_session, tiny_target_path, tiny_engine, tmp_path_factory):
    """The live drafter (arithmetic + counting), its regen folder, the server with the traffic log, story traffic."""
    from eaglenest.drafter.export import export_drafter
    from eaglenest.drafter.quick_shards import chat_samples, write_quick_shards
    from eaglenest.drafter.spec_fit import FitConfig, fit_drafter
    from eaglenest.serve.cli import start_serve

    root = tmp_path_factory.mktemp("flywheel")
    dom = _by_domain()
    original = [_first_exchange(c) for c in dom["math"][:100] + dom["count"][:100]]
    samples = chat_samples(tiny_engine, original, regenerate=True, max_new_tokens=40)
    write_quick_shards(tiny_engine, samples, root / "original", rows_per_shard=32, source="original")
    fit = fit_drafter(tiny_engine, samples, FitConfig(steps=80, batch_size=16, draft_vocab_size=1024, ttt_steps=4,
                                                      learning_rate=3e-3, seed=0))
    live = export_drafter(fit.drafter, root / "live", dtype="float32")
    regression = [{"messages": _prompt(c), "domain": d}
                  for d in ("math", "count") for c in dom[d][300:306]]
    (root / "regression.jsonl").write_text("".join(json.dumps(r) + "\n" for r in regression))

    hook = HTTPServer(("127.0.0.1", 0), _Webhook)
    threading.Thread(target=hook.serve_forever, daemon=True).start()
    port = _free_port()
    cfg = {
        "target": {"model": str(tiny_target_path), "device": "cpu", "dtype": "float32"},
        "serve": {"port": port, "num_cpus_per_replica": 0.25, "drain_timeout_s": 10, "max_tokens_limit": 64,
                  "spec": {"num_steps": 3, "topk": 1, "num_draft_tokens": 4},
                  "traffic_log": {"path": str(root / "traffic"), "sample_rate": 1.0}},
        "regen": {"batch_size": 8, "num_cpus_per_actor": 0.5, "min_tokens": 4, "max_tokens": 512,
                  "rows_per_shard": 16},
        "train": {"ttt_steps": 4, "batch_size": 8, "max_steps": 48, "learning_rate": 0.001, "warmup_ratio": 0.05,
                  "eval_fraction": 0.2, "eval_every": 16, "eval_max_samples": 16, "checkpoint_every": 16,
                  "keep_checkpoints": 3, "log_every": 16, "num_workers": 1, "cpus_per_worker": 1},
        "bench": {"prompts": str(root / "regression.jsonl")},
        "flywheel": {"workdir": str(root / "work"), "app": APP, "url": f"http://127.0.0.1:{port}",
                     "original_data": str(root / "original"), "traffic_share": 0.3, "min_traffic_samples": 32,
                     "heldout_fraction": 0.25, "max_heldout": 12, "max_regression": 12, "max_new_tokens": 40,
                     "margin": 0.05, "tolerance": 0.05, "select_max_prompts": 8,
                     "watch": {"requests": 16, "timeout_s": 240, "min_requests": 8, "tolerance": 0.05, "poll_s": 1},
                     "alert_webhook": f"http://127.0.0.1:{hook.server_port}/alerts"},
    }
    config = root / "serve.yaml"
    config.write_text(yaml.safe_dump(cfg))
    from eaglenest.config import load_config

    url = start_serve(load_config(config), str(live), port=port, name=APP)
    stories = list({json.dumps(_prompt(c)): _prompt(c) for c in dom["story"][:200]}.values())[:80]  # distinct
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)

    def ask(messages: list[dict]) -> None:
        client.chat.completions.create(model="eaglenest", messages=messages, temperature=0, max_tokens=40)

    # one at a time, and the streaming client's prompts once more at the end: the log then holds the same records in
    # the same order on every run (the turn dedups the client's repeats into these), so the turn's split, training
    # data and outcome do not depend on thread timing
    for m in stories:
        ask(m)
    # what the streaming client asks during the swaps: stories it did not send before, and arithmetic
    asks = [m for m in (_prompt(c) for c in dom["story"][200:260]) if m not in stories][:4]
    asks += [_prompt(c) for c in dom["math"][310:312]]
    for m in asks:
        ask(m)
    sp = SamplingParams(temperature=0.0, max_new_tokens=40)
    served_text = ChatFormat.from_tokenizer(tiny_engine.tokenizer)  # as served: reasoning markers kept in content
    cases = [(m, served_text.decode(tiny_engine.generate_ids([tiny_engine.render_prompt(m)], sp)[0].token_ids,
                                    tools=False)) for m in asks]
    yield {"root": root, "config": config, "url": url, "live": str(live), "cases": cases,
           "env": dict(os.environ, RAY_ADDRESS=ray_session.get_runtime_context().gcs_address)}
    from eaglenest.serve.cli import stop_serve

    stop_serve()  # Serve itself, not only the app: the next module starts Serve on a port of its own
    hook.shutdown()
    hook.server_close()


def _health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=30).json()


def _cli(world, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eaglenest.cli", *args, "--config", str(world["config"])],
                          env=world["env"], capture_output=True, text=True, timeout=timeout, cwd=world["root"])


def _audit(world) -> list[dict]:
    path = world["root"] / "work" / "audit.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def test_the_traffic_log_holds_the_served_stories(world) -> None:
    from eaglenest.flywheel.traffic import read_traffic

    health = _health(world["url"])
    assert health["drafter"] == world["live"] and health["traffic_log"]["logged"] >= 80
    records, skipped, _ = read_traffic(world["root"] / "traffic")
    assert len(records) >= 80 and skipped.get("bad_record", 0) == 0
    assert all(r["drafter"] == world["live"] and r["loss_mask"][-1] == 1 for r in records)
    # the live drafter never saw stories: its served accept length there is close to 1
    served = sum(r["spec"]["accepted_tokens"] for r in records) / sum(r["spec"]["verify_steps"] for r in records)
    assert served < 0.5, f"the live drafter accepts {served:.2f} draft tokens per step on stories"


def test_the_gate_refuses_an_untrained_candidate(world, tiny_engine) -> None:
    from eaglenest.drafter.export import export_drafter
    from eaglenest.drafter.spec_fit import untrained_like
    from eaglenest.drafters.eagle3.model import load_drafter

    fresh = untrained_like(load_drafter(world["live"]), tiny_engine.lm_head_weight())
    untrained = export_drafter(fresh, world["root"] / "untrained", dtype="float32")
    r = _cli(world, "promote", "--serve", world["url"], "--candidate", str(untrained))
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert "gate: REFUSE" in r.stdout and "does not win on held-out traffic" in r.stdout
    (gate,) = [a for a in _audit(world) if a["event"] == "gate"]
    assert gate["decision"] == "refuse" and gate["candidate"] == str(untrained) and gate["live"] == world["live"]
    held = gate["sets"]["heldout"]
    assert held["candidate"]["accept_length"] < held["live"]["accept_length"] * 1.05
    assert gate["sets"]["regression"]["candidate"]["accept_length"] < gate["sets"]["regression"]["live"][
        "accept_length"]
    assert _health(world["url"])["drafter"] == world["live"]  # nothing was swapped


def test_one_turn_retrains_from_traffic_and_swaps_without_a_failed_request(world) -> None:
    with StreamingClient(world["url"], world["cases"]) as client:
        r = _cli(world, "flywheel", "--once")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert client.errors == [] and client.mismatches == [], (client.errors[:3], client.mismatches[:3])
    assert client.ok >= 16
    turn = [a for a in _audit(world) if a["event"] == "turn"][-1]
    assert turn["outcome"] == "promoted and kept", turn
    tdir = world["root"] / "work" / "turn-0001"
    # captured, not regenerated: regen read the traffic as native samples
    manifest = json.loads((tdir / "regen" / "manifest.json").read_text())
    assert manifest["num_samples"] == turn["traffic_train"] and manifest["last_run"]["generated_tokens"] == 0
    # trained from the live drafter over traffic + the original data (train.mix at flywheel.traffic_share 0.3: at
    # 0.5 the candidate forgot ~8% of its arithmetic accept length and the gate rightly refused it)
    train_log = (tdir / "train" / "metrics.jsonl").read_text()
    summary = json.loads((tdir / "train" / "summary.json").read_text())
    assert "mix: " in r.stdout and 1.6 * turn["traffic_train"] * 0.8 < summary["train_samples"], summary
    assert f"starting from {world['live']} (its weights, shape and draft vocab)" in r.stdout
    assert [json.loads(x)["kind"] for x in train_log.splitlines()][:1] == ["eval"]
    assert 0 < turn["live_vocab_coverage"] <= 1
    selection = json.loads((tdir / "train" / "selection.json").read_text())
    assert len(selection["checkpoints"]) >= 2 and all(c["accept_length"] for c in selection["checkpoints"])
    # chosen among the checkpoints that keep the regression set (a fine-tune's best held-out step can be one that
    # forgot arithmetic: the gate would refuse it)
    assert selection["chosen"]["keeps"] and selection["live_regression"]["accept_length"] > 1, selection
    gate = [a for a in _audit(world) if a["event"] == "gate"][-1]
    held, reg = gate["sets"]["heldout"], gate["sets"]["regression"]
    assert gate["decision"] == "promote"
    assert held["candidate"]["accept_length"] > 1.3 * held["live"]["accept_length"], held
    assert reg["candidate"]["accept_length"] >= 0.95 * reg["live"]["accept_length"], reg
    staged = [a for a in _audit(world) if a["event"] == "swap"][-1]["drafter"]
    health = _health(world["url"])
    assert health["drafter"] == staged and health["status"] == "ok"
    watch = [a for a in _audit(world) if a["event"] == "watch"][-1]
    assert watch["verdict"] == "keep" and watch["requests"] >= 16, watch


def test_a_drafter_broken_on_its_way_to_the_server_is_rolled_back(world) -> None:
    from safetensors.torch import load_file, save_file

    from eaglenest.config import load_config
    from eaglenest.flywheel import Flywheel, heldout_prompts, run_gate, stage, swap_and_watch

    cfg = load_config(world["config"])
    cfg = cfg.model_copy(update={"flywheel": {**cfg.flywheel, "margin": 0.0}})  # an equal candidate may pass
    fw = Flywheel.create(cfg, str(world["config"]))
    live = fw.live_drafter()
    decision = run_gate(fw, live, heldout_prompts(fw, world["root"] / "work/turn-0001/traffic/heldout.jsonl"))
    assert decision.promote, decision.reasons
    staged = stage(fw.workdir, live, "injected")
    weights = staged / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["lm_head.weight"] = -tensors["lm_head.weight"]  # the silent failure: every draft is the least likely
    save_file(tensors, str(weights), metadata={"format": "pt"})
    _Webhook.received.clear()
    with StreamingClient(world["url"], world["cases"]) as client:
        out = swap_and_watch(fw, staged, decision)
    assert client.errors == [] and client.mismatches == [], (client.errors[:3], client.mismatches[:3])
    assert out["rolled_back"] and out["watch"]["verdict"] == "rollback"
    assert out["watch"]["live_accept_length"] < 1.15 < out["watch"]["previous_level"]
    rb = [a for a in _audit(world) if a["event"] == "rollback"][-1]
    assert rb["restored"] == live and rb["rolled_back"] == str(staged) and rb["weights_changed_after_gate"]
    assert rb["alert_delivery"] == "delivered"
    (alert,) = _Webhook.received
    assert alert["alert"] == "EaglenestDrafterRolledBack" and alert["restored"] == live
    assert _health(world["url"])["drafter"] == live


def test_a_served_schedule_is_re_tuned_for_the_promoted_drafter_and_restored_on_rollback(world) -> None:
    """serve.schedule is bound to its drafter's weights, so a promotion re-tunes the candidate the way the live
    schedule was tuned (its settings and prompts, the serving engine) and swaps drafter and schedule together, with
    no failed request; a rollback restores both. The candidate is the first live drafter (other weights than the
    live one: serve would refuse the live schedule for it)."""
    from eaglenest.config import load_config
    from eaglenest.flywheel import Flywheel, heldout_prompts, run_gate, stage, swap_and_watch
    from eaglenest.flywheel.retune import with_schedule
    from eaglenest.flywheel.watch import WatchResult, rollback
    from eaglenest.serve import redeploy_drafter
    from eaglenest.speculative.identity import serving_identity
    from eaglenest.speculative.schedule import Schedule
    from eaglenest.speculative.tune import TuneSettings
    from eaglenest.speculative.tune_run import tune_to_folder

    cfg = load_config(world["config"])
    # the throughput comparison's own rule is unit-tested; here a CPU's noise must not decide whether the swap runs
    cfg = cfg.model_copy(update={"flywheel": {**cfg.flywheel, "margin": 0.0, "tolerance": 0.6,
                                              "watch": {**cfg.flywheel["watch"], "tolerance": 0.9}}})
    fw = Flywheel.create(cfg, str(world["config"]))
    live = fw.live_drafter()
    assert live != world["live"]
    settings = TuneSettings(batch_sizes=[1, 2], candidates=["3-1-4"], temperatures=[0.0], repeats=2,
                            max_new_tokens=8, num_prompts=2, noise_floor=0.01,
                            prompts=str(world["root"] / "regression.jsonl"))
    old = str(tune_to_folder(cfg, cfg.target, settings, live, world["root"] / "tuned-live", progress=False).path)
    redeploy_drafter(with_schedule(cfg, old), live, app=APP, surge_percent=100)
    assert _health(world["url"])["schedule"]["path"] == old
    decision = run_gate(fw, live, heldout_prompts(fw, world["root"] / "work/turn-0001/traffic/heldout.jsonl"))
    assert decision.promote, decision.reasons
    staged = stage(fw.workdir, world["live"], "retuned")
    with StreamingClient(world["url"], world["cases"]) as client:
        out = swap_and_watch(fw, staged, decision)
    assert client.errors == [] and client.mismatches == [], (client.errors[:3], client.mismatches[:3])
    retuned = out["retune"]
    assert retuned["keeps"] and retuned["live_schedule"] == old, retuned
    new = Schedule.load(retuned["schedule"])
    assert new.identity["drafter"] == serving_identity(cfg.target, str(staged))["drafter"] != \
        Schedule.load(old).identity["drafter"], "tuned for the candidate's weights"
    assert new.settings["batch_sizes"] == [1, 2] and new.settings["candidates"] == ["3-1-4"]
    assert [r["batch_size"] for r in retuned["comparison"]["rows"]] == [1, 2]
    assert out["watch"]["verdict"] in ("keep", "inconclusive") and not out["rolled_back"], out["watch"]
    health = _health(world["url"])
    assert health["drafter"] == str(staged) and health["schedule"]["path"] == retuned["schedule"], health
    assert fw.state["schedule"] == retuned["schedule"] and fw.state["previous_schedule"] == old

    result = WatchResult("rollback", 1.0, 16, 2.0, None, "a rollback asked for by the test")
    with StreamingClient(world["url"], world["cases"]) as client:
        rb = rollback(fw, str(staged), live, result, None, schedule=old)
    assert client.errors == [] and client.mismatches == [], (client.errors[:3], client.mismatches[:3])
    assert rb["restored"] == live and rb["restored_schedule"] == old
    health = _health(world["url"])
    assert health["drafter"] == live and health["schedule"]["path"] == old, health
    assert fw.state["schedule"] == old
