"""``eaglenest tune`` on the tiny target, and serve applying a schedule (issue 29's CPU acceptance).

- tune, run as its own process, measures the baseline, "off" and two chains at batch 1 and 2, writes the schedule,
  its page and its plot; every bucket's choice is re-derived here from the raw measurements; a second run with one
  more batch size measures only that one (resumed from the measurements file); measurements of another drafter in
  the same folder are refused, naming the fix.
- serve (Ray Serve over HTTP, the official ``openai`` client, the decoder in its own process) applies a schedule that
  speculates alone and stops at two or more requests: /health shows the live mode switch with the load, and usage
  shows a lone request drafting.
- the same schedule with ``serve.route.by_load``: two engines, a lone request on the speculative one, a burst on
  the plain one (equal greedy answers), back to the speculative one once the plain one drained.
- ``serve.route.placement: deployments``: a speculative and a plain engine deployment behind the routing ingress,
  a burst split by the schedule's measured curves (equal greedy answers, drafts only from the speculative side);
  with two ingress replicas, each routes its share of the speculative range (a burst reaches it from both, never
  past the range).
- ``eaglenest serve`` refuses a schedule tuned for another drafter before anything starts, naming the fix.
"""

from __future__ import annotations

import json
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import openai
import pytest
from conftest import FIXTURES
from serve_helpers import StreamingClient, make_drafter

HELDOUT = FIXTURES / "prompts" / "heldout.jsonl"


def _tune(cfg: Path, drafter: Path, out: Path, batch_sizes: str, *more: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eaglenest.cli", "tune", "--config", str(cfg), "--drafter",
                           str(drafter), "--batch-sizes", batch_sizes, "--steps", "1,2", "--temperatures", "0",
                           "--repeats", "2", "--max-new-tokens", "12", "--num-prompts", "2", "--output", str(out),
                           "--no-progress", *more], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def folders(tiny_target_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("tune")
    cfg = root / "cfg.yaml"
    cfg.write_text(f"target: {{model: {tiny_target_path}, engine: hf, device: cpu, dtype: float32}}\n"
                   f"tune: {{prompts: {HELDOUT}}}\n")
    return {"root": root, "cfg": cfg, "drafter": make_drafter(root / "drafter", tiny_target_path),
            "other": make_drafter(root / "other", tiny_target_path, seed=1)}


def _reports(out: Path) -> dict[int, list[dict]]:
    per: dict[int, list[dict]] = {}
    for line in (out / "measurements.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["kind"] == "report":
            per.setdefault(rec["batch_size"], []).append(rec["report"])
    return per


def test_tune_writes_a_schedule_that_follows_its_measurements_and_resumes(folders):
    out = folders["root"] / "out"
    first = _tune(folders["cfg"], folders["drafter"], out, "1,2")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "serve.schedule" in first.stdout
    assert (out / "schedule.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| batch sizes |" in (out / "schedule.md").read_text()
    schedule = json.loads((out / "schedule.json").read_text())
    assert [b["label"] for b in schedule["buckets"]] == ["1", "2", "3+"]
    assert schedule["identity"]["drafter"]["fingerprint"].startswith("sha256:")
    assert schedule["identity"]["engine"]["engine"] == "hf" and schedule["drift"] is not None
    per = _reports(out)
    for b in schedule["buckets"][:2]:  # the rule, re-derived from the raw repeats
        (rep,) = per[b["max_batch"]]
        base = rep["baseline"]["tok_per_s_rounds"]
        noise = max(0.01, (max(base) - min(base)) / statistics.median(base))
        assert b["noise"] == pytest.approx(noise, abs=1e-4)
        ok = {c["config"]: min(c["tok_per_s_rounds"]) >= (1 - noise) * statistics.median(base)
              and c["tok_per_s"] > statistics.median(base) for c in rep["configs"] if c["config"] != "off"}
        assert {c["config"] for c in rep["configs"]} == {"off", "1-1-2", "2-1-3"}
        if b["choice"]["label"] == "off":
            assert not any(ok.values()), (b, ok)
        else:
            best = max((c for c in rep["configs"] if ok.get(c["config"])), key=lambda c: c["tok_per_s"])
            assert b["choice"]["label"] == best["config"]
    assert schedule["buckets"][-1]["choice"]["label"] == "off", "nothing measured above batch 2: no speculation"

    again = _tune(folders["cfg"], folders["drafter"], out, "1,2,4", "--verify")
    assert again.returncode == 0, again.stderr[-3000:]
    per = _reports(out)
    assert sorted(per) == [1, 2, 4] and all(len(v) == 1 for v in per.values()), "only batch 4 was measured again"
    assert [b["label"] for b in json.loads((out / "schedule.json").read_text())["buckets"]] == ["1", "2", "3-4", "5+"]
    sweep = json.loads((out / "verify" / "bench-sweep.json").read_text())  # --verify: the schedule beside them
    assert [r["batch_size"] for r in sweep["rows"]] == [1, 2, 4]
    assert all(r["schedule"] > 0 and r["baseline"] > 0 for r in sweep["rows"])
    assert (out / "verify" / "bench-sweep.png").read_bytes()[:4] == b"\x89PNG"
    assert "schedule x best static" in again.stdout

    refused = _tune(folders["cfg"], folders["other"], out, "1,2")
    assert refused.returncode == 2
    assert "another tune" in refused.stderr and "drafter" in refused.stderr and "--output" in refused.stderr


# ------------------------------------------------------------------------------------------------ serve
def _schedule_for(cfg, drafter: Path, path: Path,
                  rates: dict[int, tuple[float, float]] | None = None) -> Path:
    """A schedule bound to this target, drafter and engine whose buckets speculate (3-1-4) at batch 1 and stop
    from batch 2 on (measurements written here, not by tune: the tiny target's own curve decides nothing about
    whether serve applies what a schedule says). ``rates``: {batch: (baseline tok/s, 3-1-4 tok/s)} instead."""
    from eaglenest.speculative.identity import serving_identity
    from eaglenest.speculative.schedule import build_schedule

    def rep(base: float, spec: float) -> list[dict]:
        return [{"baseline": {"tok_per_s": base, "tok_per_s_rounds": [base, base]},
                 "configs": [{"config": "off", "tok_per_s": base, "tok_per_s_rounds": [base, base]},
                             {"config": "3-1-4", "tok_per_s": spec, "tok_per_s_rounds": [spec, spec]}]}]

    rates = rates or {1: (100.0, 150.0), 2: (180.0, 120.0), 8: (400.0, 200.0)}
    s = build_schedule({b: rep(*r) for b, r in rates.items()}, serving_identity(cfg.target, drafter),
                       noise_floor=0.01)
    return s.save(path)


ACROSS_RATES = {1: (100.0, 150.0), 2: (180.0, 240.0), 8: (400.0, 200.0)}
"""3-1-4 safe up to 2 requests; from one request to two the speculative curve gains 90 tok/s, the plain one's first
request 100 and its second 80: a burst of four splits 2 / 2 across deployments (speculative, plain, speculative,
plain), where one GPU group's rule would keep one on the speculative engine"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/health", timeout=30) as r:
        return json.loads(r.read())


def _ask(client: openai.OpenAI, prompt: str, n: int = 48):
    """One greedy completion of exactly ``n`` tokens."""
    return client.completions.create(model="eaglenest", prompt=prompt, max_tokens=n, temperature=0,
                                     extra_body={"ignore_eos": True})


def _burst(client: openai.OpenAI, prompts: list[str], n: int) -> dict[int, object]:
    """The prompts at once, one thread each; answers by index."""
    out: dict[int, object] = {}
    workers = [threading.Thread(target=lambda i=i, p=p: out.__setitem__(i, _ask(client, p, n)))
               for i, p in enumerate(prompts)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return out


@pytest.fixture(scope="module")
def scheduled(ray_session, tiny_target_path, folders):
    from eaglenest.config import EaglenestConfig
    from eaglenest.serve.cli import AppSpec, start_apps, stop_serve

    base = {"target": {"model": str(tiny_target_path), "device": "cpu", "dtype": "float32"},
            "serve": {"num_cpus_per_replica": 0.25, "max_batch_size": 8}}
    cfg = EaglenestConfig.model_validate(base)
    path = _schedule_for(cfg, folders["drafter"], folders["root"] / "serve" / "schedule.json")
    cfg = EaglenestConfig.model_validate({**base, "serve": {**base["serve"], "schedule": str(path)}})
    routed = EaglenestConfig.model_validate({**base, "serve": {**base["serve"], "schedule": str(path),
                                                               "route": {"by_load": True}}})
    across_path = _schedule_for(cfg, folders["drafter"], folders["root"] / "across" / "schedule.json", ACROSS_RATES)
    across = EaglenestConfig.model_validate({**base, "serve": {
        **base["serve"], "schedule": str(across_path), "route": {"by_load": True, "placement": "deployments"}}})
    shared = EaglenestConfig.model_validate({**base, "serve": {
        **base["serve"], "num_replicas": 2, "num_cpus_per_replica": 0.1, "schedule": str(across_path),
        "route": {"by_load": True, "placement": "deployments"}}})
    urls = start_apps([AppSpec(cfg, str(folders["drafter"]), "scheduled", "/"),
                       AppSpec(routed, str(folders["drafter"]), "routed", "/routed"),
                       AppSpec(across, str(folders["drafter"]), "across", "/across"),
                       AppSpec(shared, str(folders["drafter"]), "shared", "/shared")], port=_free_port())
    yield {"scheduled": urls[0], "routed": urls[1], "across": urls[2], "across_cfg": across, "shared": urls[3]}
    stop_serve()


def test_serve_switches_the_mode_with_the_load(scheduled):
    scheduled = scheduled["scheduled"]
    client = openai.OpenAI(base_url=f"{scheduled}/v1", api_key="none", max_retries=0, timeout=120)
    h = _health(scheduled)["schedule"]
    assert h["mode"] == "per-step" and h["buckets"] == {"1": "3-1-4", "2": "off", "3-8": "off", "9+": "off"}

    alone = client.completions.create(model="eaglenest", prompt="Write a short poem about the sea.", max_tokens=24,
                                      extra_body={"ignore_eos": True})
    assert alone.usage.model_extra["spec"]["draft_tokens"] > 0, "a lone request runs in bucket 1, which speculates"
    assert _health(scheduled)["schedule"]["live"]["num_steps"] == 3

    seen: list[dict] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            seen.append(_health(scheduled)["schedule"]["live"])
            time.sleep(0.05)

    def one(i: int) -> None:
        client.completions.create(model="eaglenest", prompt=f"Count to {10 + i}.", max_tokens=96,
                                  extra_body={"ignore_eos": True})

    poller = threading.Thread(target=poll)
    poller.start()
    workers = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    done.set()
    poller.join()
    loaded = [s for s in seen if s["batch_size"] >= 2]
    assert loaded, f"four concurrent requests never decoded together: {seen[:20]}"
    assert all(s["num_steps"] == 0 for s in loaded), "two or more requests: the schedule turns speculation off"
    assert {s["bucket"] for s in loaded} <= {"2", "3-8"}

    again = client.completions.create(model="eaglenest", prompt="List three colors.", max_tokens=24,
                                      extra_body={"ignore_eos": True})
    assert again.usage.model_extra["spec"]["draft_tokens"] > 0, "alone again: speculating again"
    assert _health(scheduled)["schedule"]["live"]["num_steps"] == 3


def test_serve_routes_by_load_between_a_speculative_and_a_plain_engine(scheduled):
    """serve.route.by_load with the same schedule: a lone request runs on the speculative engine; under a burst one
    request at most drafts and the rest go to the plain engine, whose greedy answers equal the speculative engine's;
    once the plain engine has drained, a lone request speculates again."""
    url = scheduled["routed"]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    h = _health(url)
    assert h["schedule"]["mode"] == "routed" and h["route"]["limit"] == 1, h
    assert h["schedule"]["buckets"] == {"1": "3-1-4", "2": "off", "3-8": "off", "9+": "off"}
    assert any("up to 1 concurrent" in n for n in h["schedule"]["notes"]), h["schedule"]["notes"]

    alone = _ask(client, "Count to 10.")
    assert alone.usage.model_extra["spec"]["draft_tokens"] > 0, "alone: the speculative engine"
    before = _health(url)["route"]["routed"]
    burst = _burst(client, ["Count to 10.", *(f"Name {i + 2} animals." for i in range(1, 4))], 96)
    after = _health(url)["route"]
    moved = {k: after["routed"][k] - before[k] for k in before}
    assert sum(moved.values()) == 4 and moved["plain"] >= 3, (before, after)
    drafted = [r for r in burst.values() if r.usage.model_extra["spec"]["draft_tokens"] > 0]
    assert len(drafted) == moved["speculative"], "only the speculative engine's answers report drafts"
    assert burst[0].choices[0].text[:len(alone.choices[0].text)] == alone.choices[0].text, \
        "greedy: the same answer from either engine"
    assert after["running"] == {"speculative": 0, "plain": 0}
    again = _ask(client, "List three colors.")
    assert again.usage.model_extra["spec"]["draft_tokens"] > 0, "the plain engine drained: speculating again"


def test_serve_routes_across_a_speculative_and_a_plain_deployment(scheduled):
    """serve.route.placement: deployments: the engines are deployments of their own, the ingress routes each request
    where the schedule's curves gain more; a burst of four splits 2 / 2, the plain deployment's greedy answer equals
    the speculative one's, and only the speculative deployment's answers report drafts."""
    from ray import serve

    url = scheduled["across"]
    deployments = serve.status().applications["across"].deployments
    assert {"eaglenest", "eaglenest-speculative", "eaglenest-plain"} <= set(deployments), deployments
    h = _health(url)
    assert h["schedule"]["mode"] == "routed" and h["route"]["placement"] == "deployments", h
    assert h["route"]["limit"] == 2 and h["engine"] == "hf-deployment-routed", h
    predicted = h["route"]["predicted_vs_plain"]  # two requests: (150 + 100) / (100 + 100); four: (240 + 180) / 360
    assert predicted["2"] == pytest.approx(1.25, abs=1e-3) and predicted["4"] == pytest.approx(420 / 360, abs=1e-3)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)

    alone = _ask(client, "Count to 10.")
    assert alone.usage.model_extra["spec"]["draft_tokens"] > 0, "alone: the speculative deployment"
    before = _health(url)["route"]["routed"]
    burst = _burst(client, ["Count to 10."] * 4, 160)
    after = _health(url)["route"]
    moved = {k: after["routed"][k] - before[k] for k in before}
    assert moved == {"speculative": 2, "plain": 2}, (before, after)
    drafted = [r for r in burst.values() if r.usage.model_extra["spec"]["draft_tokens"] > 0]
    assert len(drafted) == 2, "only the speculative deployment's answers report drafts"
    texts = {r.choices[0].text[:len(alone.choices[0].text)] for r in burst.values()}
    assert texts == {alone.choices[0].text}, "greedy: the same answer from either deployment"
    assert after["running"] == {"speculative": 0, "plain": 0}


def test_two_ingress_replicas_share_the_speculative_range(scheduled):
    """``serve.num_replicas: 2`` in front of the two engine deployments: each ingress replica routes its share (one
    of the range of two), so a burst reaches the speculative deployment from both of them, never more than two at
    once; every answer the same greedy text."""
    from ray import serve

    url = scheduled["shared"]
    ingress = serve.status().applications["shared"].deployments["eaglenest"]
    assert ingress.replica_states.get("RUNNING") == 2, ingress.replica_states
    h = _health(url)
    assert h["route"]["placement"] == "deployments" and h["route"]["ingress_replicas"] == 2, h
    assert h["route"]["limit"] == 1, "each ingress replica's share of the range of 2"
    loads = {side: serve.get_deployment_handle(f"eaglenest-{side}", app_name="shared").load
             for side in ("speculative", "plain")}
    before = {side: load.remote().result() for side, load in loads.items()}  # the replicas' self-tests included
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    alone = _ask(client, "Count to 10.")
    assert alone.usage.model_extra["spec"]["draft_tokens"] > 0, "alone: the speculative deployment"
    burst = _burst(client, ["Count to 10."] * 8, 160)
    spec, plain = (loads[side].remote().result() for side in ("speculative", "plain"))
    assert spec["peak"] == 2, ("each ingress replica sent at most its one: a peak of two needs both, and a third "
                               f"would pass the range: {spec}")
    drafted = [r for r in burst.values() if r.usage.model_extra["spec"]["draft_tokens"] > 0]
    assert len(drafted) == 2 and spec["served"] - before["speculative"]["served"] == 3, (spec, before)
    assert plain["served"] - before["plain"]["served"] == 6, (plain, before)
    texts = {r.choices[0].text[:len(alone.choices[0].text)] for r in burst.values()}
    assert texts == {alone.choices[0].text}, "greedy: the same answer from either deployment"
    assert spec["running"] == plain["running"] == 0


def test_a_drafter_swap_rolls_the_engine_deployments_with_no_failed_request(scheduled, folders):
    """The flywheel's swap on ``placement: deployments``: the speculative engine deployment is the one a new drafter
    replaces, with surge, while a client streams; no request fails and the swap returns only once every deployment's
    old replicas are gone (a copy of the drafter: the schedule's identity is its weights, so it stays valid)."""
    from ray import serve

    from eaglenest.serve import redeploy_drafter

    url = scheduled["across"]
    copy = folders["root"] / "across" / "drafter-copy"
    shutil.copytree(folders["drafter"], copy)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Count to 10."}]
    want = client.chat.completions.create(model="eaglenest", messages=messages, temperature=0,
                                          max_tokens=40).choices[0].message.content
    with StreamingClient(url, [(messages, want)]) as streamer:
        swap = redeploy_drafter(scheduled["across_cfg"], str(copy), app="across", route_prefix="/across",
                                surge_percent=100)
    assert streamer.errors == [], streamer.errors[:3]
    assert streamer.ok >= 2 and streamer.mismatches == [], "greedy answers stay the same across the swap"
    assert set(swap["replicas"]) == {"RUNNING"}, swap
    deployments = serve.status().applications["across"].deployments
    assert {d: sum(dep.replica_states.values()) for d, dep in deployments.items()} == \
        {"eaglenest": 1, "eaglenest-speculative": 1, "eaglenest-plain": 1}
    h = _health(url)
    assert h["drafter"] == str(copy) and h["route"]["placement"] == "deployments", h
    after = _ask(client, "Count to 10.", 24)
    assert after.usage.model_extra["spec"]["draft_tokens"] > 0, "alone: the new speculative deployment drafts"


def test_shutdown_with_engine_deployments_drains_at_once(scheduled):
    """Nothing in flight: stopping Serve waits for the ingress replicas' drain reports only. The engine deployments
    answer no drain request (Serve's graceful shutdown stops them); counted among those expected to answer, they
    held every shutdown of a ``placement: deployments`` application to ``serve.drain_timeout_s`` (30 s) + 3 s."""
    from eaglenest.serve.cli import stop_serve
    from eaglenest.serve.drain import running_replicas

    assert running_replicas() == 5, "scheduled, routed and across: one ingress each; shared: two"
    t0 = time.monotonic()
    stop_serve()
    took = time.monotonic() - t0
    assert took < 20, f"stopping Serve took {took:.1f} s with nothing in flight"


def test_serve_refuses_a_schedule_of_another_drafter(folders, tiny_target_path):
    root = folders["root"] / "stale"
    root.mkdir()
    from eaglenest.config import EaglenestConfig

    target = {"model": str(tiny_target_path), "device": "cpu", "dtype": "float32"}
    path = _schedule_for(EaglenestConfig.model_validate({"target": target}), folders["drafter"],
                         root / "schedule.json")
    cfg = root / "serve.yaml"
    cfg.write_text(json.dumps({"target": target, "serve": {"drafter": str(folders["other"]), "schedule": str(path),
                                                          "port": _free_port()}}))
    proc = subprocess.run([sys.executable, "-m", "eaglenest.cli", "serve", "--config", str(cfg)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    err = proc.stderr
    assert "stale" in err and "drafter: tuned on" in err and str(folders["other"]) in err
    assert f"eaglenest tune --config <this serving config> --drafter {folders['other']}" in err
