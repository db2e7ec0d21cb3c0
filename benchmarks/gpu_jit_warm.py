"""Compile SGLang's kernels for a DeepseekV3 stand-in's widths while the stand-in itself is still being built.

A fresh device machine compiles SGLang's JIT kernels (sgl-kernel's, Triton's fused-MoE and MLA attention kernels, each
specialised on the model's widths) at the first engine start that needs them: a minute or more of a 30-minute device
session, paid on the run's critical path. ``benchmarks/gpu_e2e.sh`` runs this script in the background during its
phase A (the stand-in's pre-training and widening), so the compiled kernels are in the caches (``TRITON_CACHE_DIR``,
``TVM_FFI_CACHE_DIR``) when regen starts its engine.

It builds a random DeepseekV3 with the stand-in's exact widths (hidden, MLA ranks and head dims, experts, vocabulary)
but only ``--layers`` layers (a few GB), random drafters of the run's draft shapes for it, and starts SGLang the ways
the run will: plain on triton (regen's and its offline reference's backend: prefill, decode, the decode graphs up to
the bench's batch), EAGLE3 with each drafter on ``--attention`` (the bench's, the EAGLE check's and serve's backend:
draft, verify with its tree mask, their graphs), then plain on ``--attention`` (the bench's baseline). Its outputs are
discarded; only the caches matter, and each engine's record (start seconds or the error) tells the run whether
``--attention`` works on this machine before any 44 GB engine depends on it. The engines take little GPU memory
(``max_total_tokens`` caps the KV pool), so pre-training on the same GPU is unaffected.

``--part`` splits the plan by when the run needs it: ``regen`` (the plain triton engine: regen and its offline
reference, in phase A beside the stand-in's pre-training), ``bench`` (the bench's engines, with its exact decode-graph
batch sizes ``--graph-bs``: beside the drafters' training, which leaves the GPU room and lasts longer than the
warm-up), or ``all``. In the ninth Kimi-width attempt the whole plan beside pre-training had not reached the bench's
engines when regen needed the GPU, so the bench would have compiled them on its own clock.

    python3 benchmarks/gpu_jit_warm.py --preset default --routed-experts 4 --experts-per-token 4 --work /tmp/jitwarm \
        --attention flashinfer --part bench --graph-bs 1,2,4,8,16,32
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def warm_config(preset: str, routed: int | None, per_token: int | None, layers: int) -> dict[str, Any]:
    """The stand-in's wide config.json (the same builder as ``standin-target --arch deepseek_v3``), cut to
    ``layers`` layers: every width a kernel is specialised on is the run's."""
    from eaglenest.engines.standin_deepseek import DEEPSEEK_PRESETS, _Vocab, small_config, with_experts
    from eaglenest.engines.widen_deepseek import widen_deepseek_config

    spec = with_experts(DEEPSEEK_PRESETS[preset], routed, per_token)
    cfg = widen_deepseek_config(small_config(spec, _Vocab(spec.vocab_size)).to_dict(), spec.wide)
    cfg["num_hidden_layers"] = layers
    cfg["torch_dtype"] = "bfloat16"
    return cfg


def build_target(cfg: dict[str, Any], folder: Path, device: str) -> Path:
    """A random-weight DeepseekV3ForCausalLM of ``cfg`` in ``folder`` (safetensors, its config.json as given)."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    with torch.device(device):
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**cfg)).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))  # the keys SGLang reads that transformers drops
    return folder


def build_drafters(target: Path, work: Path, draft_vocab: int = 32000,
                   shapes: tuple[str, ...] = ("llama", "mla")) -> dict[str, Path]:
    """A random drafter of each of ``shapes`` for ``target`` in eaglenest's SGLang export format."""
    import torch
    from safetensors import safe_open

    from eaglenest.contracts.target import TargetSpec
    from eaglenest.drafter.export import export_drafter
    from eaglenest.drafter.shape import drafter_model_config
    from eaglenest.drafters.eagle3.model import Eagle3Drafter
    from eaglenest.drafters.vocab import build_vocab_mapping

    facts = TargetSpec.read(str(target))
    n = facts.num_layers  # three distinct taps SGLang's DeepseekV2 rule can express (the first one >= 2)
    taps = [2, n // 2 + 1, n - 1]
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(target.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                if k in ("model.embed_tokens.weight", "lm_head.weight"):
                    tensors[k] = st.get_tensor(k).float()
    mapping = build_vocab_mapping(torch.arange(facts.vocab_size, 0, -1, dtype=torch.float64),
                                  min(draft_vocab, facts.vocab_size))
    out = {}
    for shape in shapes:
        cfg = drafter_model_config(facts, taps, mapping.draft_vocab_size, draft_shape=shape)
        drafter = Eagle3Drafter(cfg)
        drafter.init_from_target(tensors["model.embed_tokens.weight"], tensors["lm_head.weight"], mapping.d2t,
                                 mapping.t2d)
        out[shape] = export_drafter(drafter, work / f"drafter-{shape}", dtype="bfloat16")
    return out


def warm_extra_args(max_bs: int, graph_bs: list[int] | None = None) -> dict[str, Any]:
    """The warm-up engines' SGLang settings beyond eaglenest's: decode graphs up to ``max_bs`` (or exactly at
    ``graph_bs``, the bench's list) and no prefill graphs (as the run's engines), a KV pool capped so the engine stays
    small beside the stand-in's pre-training or the drafters' training on the same GPU, token ids in (no
    tokenizer)."""
    graphs: dict[str, Any] = ({"cuda_graph_bs_decode": list(graph_bs)} if graph_bs
                              else {"cuda_graph_max_bs_decode": max_bs})
    return {**graphs, "disable_prefill_cuda_graph": True, "max_total_tokens": 65536, "skip_tokenizer_init": True}


PARTS = ("regen", "bench", "all")


def warm_plan(drafters: dict[str, Path], attention: str, part: str = "all") -> list[tuple[str, str]]:
    """(engine, attention backend) in the order the warm-up starts them: regen's plain triton engine first (the run
    needs it first), then the speculative engines on ``attention`` (the riskiest: their result decides the bench's
    backend), then the plain baseline on ``attention`` (part ``all``: when it is not triton, as regen's engine
    warmed it; part ``bench``: always, since the bench's graph batch sizes are its own). ``part`` keeps regen's or
    the bench's share of that order."""
    if part not in PARTS:
        raise ValueError(f"part {part!r}: one of {PARTS}")
    regen = [("plain", "triton")]
    spec = [(name, attention) for name in drafters]
    if part == "regen":
        return regen
    if part == "bench":
        return [*spec, ("plain", attention)]
    return regen + spec + ([("plain", attention)] if attention != "triton" else [])


DIED_DURING_START = ("the warm-up process ended during this engine's start (SGLang ends its parent's whole process "
                     "tree when a scheduler fails to start): see jit-warm.log")


INTERRUPTED = ("ended by the run's deadline for the warm-up during this engine's start: not tried, not failed")


SIGTERM_DEATH = "exit code: -15"
"""how SGLang reports a scheduler ended by SIGTERM, the signal the run's deadline sends the warm-up's process group"""


def settle_records(records: list[dict[str, Any]], ended_by_deadline: bool) -> list[dict[str, Any]]:
    """The warm-up's records as the run reads them. An engine is saved as failed (:data:`DIED_DURING_START`) before
    its start, so a start that kills this process is still reported; but when the run itself ended this process at
    its deadline (the eighth Kimi-width run: SIGTERM ~115 s into the Llama-shaped draft's start on flashinfer,
    which took 139 s in the seventh), that record was interrupted, and calling it failed would push the bench onto
    triton for no fault of the backend. The same holds for an engine whose scheduler the deadline's SIGTERM reached
    first (the process group's signal): this process then records SGLang's "scheduler died during initialization
    (exit code: -15)" itself (the small-preset run of 2026-12-06 moved its bench to triton so)."""
    if not ended_by_deadline:
        return records
    out = []
    for rec in records:
        error = rec.get("error") or ""
        if error == DIED_DURING_START or SIGTERM_DEATH in error:
            rec = {k: v for k, v in rec.items() if k != "error"} | {"interrupted": INTERRUPTED}
        out.append(rec)
    return out


def warm_engines(target: Path, drafters: dict[str, Path], max_bs: int, attention: str = "triton",
                 log: Any = print, save: Any = None, part: str = "all",
                 graph_bs: list[int] | None = None) -> list[dict[str, Any]]:
    """Start SGLang as :func:`warm_plan` says (EAGLE3 3-1-4 with a drafter); decode at batch 1 and ``max_bs`` in
    each. ``save(records)``, when given, is called before each engine start with that engine marked as failed
    (:data:`DIED_DURING_START`) and after it with its outcome, so a start that kills this process still leaves its
    failure in the report."""
    from eaglenest.config import SGLangEngineConfig, SpecConfig
    from eaglenest.contracts.target import TargetSpec
    from eaglenest.engines.sglang.args import engine_kwargs
    from eaglenest.engines.sglang.engine import sglang_symbol
    from eaglenest.engines.sglang.limits import speculative_running_requests
    from eaglenest.engines.sglang.spec import speculative_engine_kwargs

    facts = TargetSpec.read(str(target), context_length=2048)
    Engine = sglang_symbol("sglang:Engine")
    records = []
    for name, backend in warm_plan(drafters, attention, part):
        # regen's plain triton engine keeps SGLang's ladder up to max_bs; the bench's engines capture its exact list
        bench_engine = part == "bench" or (part == "all" and (name, backend) != ("plain", "triton"))
        cfg = SGLangEngineConfig(mem_fraction_static=0.88, context_length=2048, attention_backend=backend,
                                 extra_args=warm_extra_args(max_bs, graph_bs if bench_engine else None))
        t0 = time.perf_counter()
        if save is not None:
            save([*records, {"engine": name, "attention": backend, "error": DIED_DURING_START}])
        try:
            if name == "plain":
                kw = engine_kwargs(str(target), cfg, dtype="bfloat16", target=facts)
            else:
                kw, _ = speculative_engine_kwargs(str(target), cfg, drafters[name], SpecConfig(), dtype="bfloat16")
                kw.update(speculative_running_requests(kw, max_bs))  # as the bench launches them (bench_cli)
            eng = Engine(**kw)
            start_s = time.perf_counter() - t0
            try:
                for bs in (1, max_bs):
                    prompts = [[100 + (7 * i + j) % 5000 for j in range(48)] for i in range(bs)]
                    eng.generate(input_ids=prompts, sampling_params={"temperature": 0.0, "max_new_tokens": 16,
                                                                     "ignore_eos": True})
            finally:
                eng.shutdown()
            rec = {"engine": name, "attention": backend, "start_s": round(start_s, 1),
                   "total_s": round(time.perf_counter() - t0, 1)}
        except Exception as e:  # noqa: BLE001 - a warm-up that fails costs the run nothing but the compile time
            rec = {"engine": name, "attention": backend, "error": f"{type(e).__name__}: {e}"[:1500],
                   "total_s": round(time.perf_counter() - t0, 1)}
        log(f"[jit warm] {json.dumps(rec)}")
        records.append(rec)
        if save is not None:
            save(records)
    return records


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="default", help="standin-target --arch deepseek_v3 preset")
    p.add_argument("--routed-experts", type=int, default=None)
    p.add_argument("--experts-per-token", type=int, default=None)
    p.add_argument("--layers", type=int, default=5, help="layers of the warm-up model (>= 5: three distinct taps)")
    p.add_argument("--max-bs", type=int, default=32, help="the largest batch the run decodes with CUDA graphs")
    p.add_argument("--work", default="/tmp/jitwarm")
    p.add_argument("--attention", default="triton",
                   help="SGLang attention backend of the speculative engines and the baseline (regen's stays triton)")
    p.add_argument("--shapes", default="llama,mla", help="draft shapes to warm (comma-separated)")
    p.add_argument("--part", default="all", choices=PARTS,
                   help="regen: the plain triton engine; bench: the bench's engines; all: both, in that order")
    p.add_argument("--graph-bs", default="",
                   help="the bench engines' decode graph batch sizes (comma-separated; default: up to --max-bs)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--build-only", action="store_true", help="build the model and drafters, start no engine")
    a = p.parse_args(argv)
    if a.layers < 5:
        p.error("--layers must be at least 5 (the drafters read three distinct layers, the first at 2)")
    t0 = time.perf_counter()
    work = Path(a.work)
    cfg = warm_config(a.preset, a.routed_experts, a.experts_per_token, a.layers)
    target = build_target(cfg, work / "target", a.device)
    drafters = ({} if a.part == "regen" else
                build_drafters(target, work, shapes=tuple(x for x in a.shapes.split(",") if x)))
    print(f"[jit warm] built a {a.layers}-layer model and {len(drafters)} drafters in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    def save(records: list[dict[str, Any]]) -> None:
        (work / "warm.json").write_text(json.dumps({"engines": records, "seconds": round(time.perf_counter() - t0, 1)},
                                                   indent=2))

    graph_bs = [int(x) for x in a.graph_bs.split(",") if x] or None
    records = [] if a.build_only else warm_engines(target, drafters, a.max_bs, a.attention, save=save, part=a.part,
                                                   graph_bs=graph_bs)
    save(records)
    print(f"[jit warm] done in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
