"""``eaglenest demo``: the whole loop on the embedded tiny target, on a laptop CPU, in one command.

Stages, each reusing its finished output in ``--workdir`` unless ``--fresh``: build the tiny target, regenerate the
10 fixture sources (Ray Data), train the drafter (Ray Train), evaluate untrained vs trained accept length, serve the
trained drafter (Ray Serve, 127.0.0.1) and send OpenAI requests, benchmark speculative vs baseline decoding, and
print a summary of every number and where every artifact is.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

STAGES = ("target", "regen", "train", "eval", "serve", "bench")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", default="demo-work", help="where every artifact goes (default: ./demo-work)")
    p.add_argument("--config", default=None, help="demo config (default: configs/demo.yaml)")
    p.add_argument("--fresh", action="store_true", help="redo every stage instead of reusing finished ones")
    p.add_argument("--port", type=int, default=None, help="HTTP port for the serve stage (default: serve.port)")


class Demo:
    """Runs the stages in order; each stage's summary is saved to ``WORK/<stage>/stage.json`` and reused."""

    def __init__(self, work: Path, cfg: Any, fresh: bool, port: int | None) -> None:
        self.work, self.cfg, self.fresh, self.port = work, cfg, fresh, port
        self.results: dict[str, dict[str, Any]] = {}

    def stage(self, index: int, name: str, fn: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
        folder = self.work / name
        done = folder / "stage.json"
        print(f"\n=== {index}/{len(STAGES)} {name} ===", flush=True)
        if done.is_file() and not self.fresh:
            result = json.loads(done.read_text())
            print(f"reusing {done} (finished earlier; --fresh redoes it)")
        else:
            folder.mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            result = fn(folder)
            result["seconds"] = round(time.perf_counter() - t0, 1)
            done.write_text(json.dumps(result, indent=2, default=str) + "\n")
        self.results[name] = result
        return result


def run(args: argparse.Namespace) -> int:
    from eaglenest.config import load_config

    for k, v in {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
                 "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"}.items():
        os.environ.setdefault(k, v)
    work = Path(args.workdir).resolve()
    if args.fresh and work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    cfg = load_config(args.config or _default_config())
    demo = Demo(work, cfg, args.fresh, args.port)
    t_start = time.perf_counter()
    ray_info = _start_ray()
    try:
        demo.stage(1, "target", lambda d: _target_stage(cfg))
        regen = demo.stage(2, "regen", lambda d: _regen_stage(cfg, d))
        train = demo.stage(3, "train", lambda d: _train_stage(cfg, Path(regen["output"]), d))
        drafter_dir = train["export"]
        demo.stage(4, "eval", lambda d: _eval_stage(cfg, drafter_dir, d))
        demo.stage(5, "serve", lambda d: _serve_stage(cfg, drafter_dir, d, args.port))
        demo.stage(6, "bench", lambda d: _bench_stage(cfg, drafter_dir, d))
    finally:
        _stop_ray(ray_info)
    summary = _summary(demo.results, work, ray_info, time.perf_counter() - t_start)
    (work / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    _print_summary(summary)
    return 0


# ------------------------------------------------------------------------------------------------------ stages
def _target_stage(cfg: Any) -> dict[str, Any]:
    from eaglenest.engines.location import resolve_target_path

    path = resolve_target_path(cfg.target)
    print(f"target: {path}")
    return {"path": path}


def _regen_stage(cfg: Any, folder: Path) -> dict[str, Any]:
    from eaglenest.regen import run_regen

    s = run_regen(cfg, folder / "data")
    return {k: s.get(k) for k in ("output", "num_samples", "num_tokens", "num_loss_tokens", "samples_per_source",
                                  "quarantined_per_reason", "bytes_per_token", "hidden_size", "aux_layer_ids",
                                  "dtype")}


def _train_stage(cfg: Any, data_dir: Path, folder: Path) -> dict[str, Any]:
    from eaglenest.drafter import train_drafter

    s = train_drafter(cfg, data_dir, folder)
    s.setdefault("export", str(folder / "export"))
    return s


def _heldout_prompts(cfg: Any) -> list[dict[str, Any]]:
    from eaglenest.speculative.evaluate import load_prompts

    path = cfg.resolve(cfg.bench.prompts)
    if not path:
        raise ValueError("configs/demo.yaml needs bench.prompts (a JSONL of held-out prompts)")
    return load_prompts(path, limit=cfg.bench.num_prompts)


def _eval_stage(cfg: Any, drafter_dir: str, folder: Path) -> dict[str, Any]:
    """Accept length of the trained drafter vs the same drafter freshly initialised, on held-out prompts."""
    import torch

    from eaglenest.drafters.eagle3.model import load_drafter
    from eaglenest.engines import load_engine
    from eaglenest.speculative.evaluate import evaluate_acceptance, plot_acceptance

    engine = load_engine(cfg.target)
    prompts = _heldout_prompts(cfg)
    spec = cfg.serve.spec
    trained = load_drafter(drafter_dir, device=engine.device, dtype=engine.dtype)
    untrained = load_drafter(drafter_dir, device=engine.device, dtype=engine.dtype)
    torch.manual_seed(cfg.train.seed)  # what training started from: random layers, target embedding and head rows
    untrained.reset_parameters()
    untrained.init_from_target(engine.embed_weight(), engine.lm_head_weight(), untrained.d2t.clone(),
                               untrained.t2d.clone())
    reports = {}
    for name, drafter in (("untrained", untrained), ("trained", trained)):
        reports[name] = evaluate_acceptance(engine, drafter, prompts, spec, progress=True)
        print(f"{name:>9}: accept length {reports[name]['accept_length']:.2f} on {len(prompts)} held-out prompts")
    (folder / "eval.json").write_text(json.dumps(reports, indent=2, default=str) + "\n")
    png = plot_acceptance(reports, folder / "acceptance.png")
    return {"untrained_accept_length": round(reports["untrained"]["accept_length"], 3),
            "trained_accept_length": round(reports["trained"]["accept_length"], 3),
            "per_domain_trained": reports["trained"].get("per_domain"),
            "prompts": len(prompts), "report": str(folder / "eval.json"), "plot": str(png)}


def _serve_stage(cfg: Any, drafter_dir: str, folder: Path, port: int | None) -> dict[str, Any]:
    from openai import OpenAI

    from eaglenest.serve.cli import start_serve, stop_serve

    url = start_serve(cfg, drafter_dir, port=port)
    print(f"serving on {url}/v1 (OpenAI-compatible)")
    try:
        client = OpenAI(base_url=f"{url}/v1", api_key=cfg.serve.api_key or os.environ.get("EAGLENEST_API_KEY", "-"))
        replies = []
        for q in ("What is 12 plus 7?", "Tell me about alice in paris."):
            r = client.chat.completions.create(model=cfg.serve.model_name, max_tokens=48, temperature=0,
                                               messages=[{"role": "user", "content": q}])
            spec = (r.usage.model_extra or {}).get("spec") or {}
            replies.append({"prompt": q, "reply": r.choices[0].message.content,
                            "completion_tokens": r.usage.completion_tokens,
                            "accept_length": spec.get("accept_length")})
            print(f"> {q}\n  {r.choices[0].message.content!r} (accept length {spec.get('accept_length')})")
        streamed = []
        stream = client.chat.completions.create(model=cfg.serve.model_name, max_tokens=48, temperature=0,
                                                stream=True,
                                                messages=[{"role": "user", "content": "What is 3 times 4?"}])
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                streamed.append(chunk.choices[0].delta.content)
        print(f"> What is 3 times 4? (streamed in {len(streamed)} chunks)\n  {''.join(streamed)!r}")
        replies.append({"prompt": "What is 3 times 4?", "reply": "".join(streamed), "chunks": len(streamed)})
    finally:
        stop_serve()
    (folder / "replies.json").write_text(json.dumps(replies, indent=2) + "\n")
    return {"url": f"{url}/v1", "requests": len(replies), "replies": replies}


def _bench_stage(cfg: Any, drafter_dir: str, folder: Path) -> dict[str, Any]:
    """Speculative vs baseline decoding on the same engine and prompts, measured side by side."""
    from eaglenest.engines import load_engine
    from eaglenest.speculative.bench import plot_bench, report_markdown, run_bench
    from eaglenest.speculative.evaluate import prompt_ids

    engine = load_engine(cfg.target)
    prompts = [prompt_ids(engine.tokenizer, p) for p in _heldout_prompts(cfg)]
    b = cfg.bench
    report = run_bench(engine, drafter_dir, prompts, b.sweep, max_new_tokens=b.max_new_tokens, repeats=b.repeats,
                       batch_size=b.batch_size)
    (folder / "bench.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (folder / "bench.md").write_text(report_markdown(report))
    png = plot_bench(report, folder / "bench.png")
    print(report["verdict"])
    best = report.get("best") or {}
    return {"speedup": round(best.get("speedup", 0.0), 2), "best_config": best.get("config"),
            "baseline_tok_per_s": round(report["baseline"]["tok_per_s"], 1),
            "spec_tok_per_s": round(best.get("tok_per_s", 0.0), 1), "verdict": report["verdict"],
            "report": str(folder / "bench.md"), "plot": str(png)}


# ------------------------------------------------------------------------------------------------ ray + summary
def _start_ray() -> dict[str, Any]:
    """Attach (inside ``ray job submit``, next to ``ray start``) or start a local Ray with its dashboard on loopback;
    training workers report their progress through the driver's log (Ray's default ``log_to_driver``)."""
    from eaglenest.runtime import start_or_attach

    started = start_or_attach(include_dashboard=True, dashboard_host="127.0.0.1", num_cpus=4)
    return {"owned": started.started, "dashboard": started.dashboard_url}


def _stop_ray(info: dict[str, Any]) -> None:
    import ray

    if info.get("owned") and ray.is_initialized():
        ray.shutdown()


def _summary(r: dict[str, dict[str, Any]], work: Path, ray_info: dict[str, Any], elapsed: float) -> dict[str, Any]:
    regen, train, ev = r.get("regen", {}), r.get("train", {}), r.get("eval", {})
    serve, bench = r.get("serve", {}), r.get("bench", {})
    return {
        "samples per source": regen.get("samples_per_source"),
        "quarantined": regen.get("quarantined_per_reason"),
        "samples / tokens": f"{regen.get('num_samples')} / {regen.get('num_tokens')}",
        "bytes per token": f"{regen.get('bytes_per_token')} (8*H = {8 * (regen.get('hidden_size') or 0)})",
        "train steps": train.get("steps") or train.get("step"),
        "held-out acc_0 / simulated accept length": _eval_pair(train),
        "accept length untrained": ev.get("untrained_accept_length"),
        "accept length trained": ev.get("trained_accept_length"),
        "speedup (spec / baseline)": bench.get("speedup"),
        "regen shards": regen.get("output"),
        "drafter export": train.get("export"),
        "eval report": ev.get("report"),
        "bench report": bench.get("report"),
        "served (stopped)": serve.get("url"),
        "ray dashboard": ray_info.get("dashboard"),
        "workdir": str(work),
        "elapsed s": round(elapsed, 1),
    }


def _eval_pair(train: dict[str, Any]) -> str | None:
    """Held-out acc_0 and simulated accept length, before -> after training."""
    first, final = train.get("first_eval") or {}, train.get("final_eval") or {}
    if not final:
        return None
    return (f"{first.get('acc_0', 0):.3f} / {first.get('sim_accept_length', 0):.2f} -> "
            f"{final.get('acc_0', 0):.3f} / {final.get('sim_accept_length', 0):.2f}")


def _default_config() -> str:
    return str(Path(__file__).resolve().parents[1] / "configs" / "demo.yaml")


def _print_summary(summary: dict[str, Any]) -> None:
    print("\n=== summary ===")
    width = max(len(k) for k in summary)
    for k, v in summary.items():
        if isinstance(v, dict):
            v = ", ".join(f"{a}={b}" for a, b in v.items()) or "none"
        print(f"{k:>{width}}  {v}")
