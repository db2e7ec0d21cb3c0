"""Capture during generation on a DeepseekV3 target (Kimi-K2.5's architecture), on a GPU with SGLang.

The hooks follow the architecture record (``eaglenest.targets.deepseek_v3``): SGLang's ``DeepseekV2DecoderLayer`` takes
7 positional arguments and returns ``(hidden, residual, topk_indices)``. This run checks that on the real engine:

1. a random-weight bf16 DeepseekV3 with Kimi-K2.5's MLA dims (64 heads, q_lora_rank 1536, kv_lora_rank 512,
   qk_nope 128, qk_rope 64, v_head 128), MoE layers with a shared expert, hidden 1024, 8 layers, is built with
   transformers (plus the keys SGLang reads that transformers' config lacks);
2. SGLang's own offline ``Engine.generate`` (CUDA graphs on) over the prompts: the reference pace;
3. eaglenest's recording engine (hooks on, CUDA graphs and radix cache off, the ring of shared memory) over the same
   prompts, its rows assembled into one Capture per sequence, at default taps [2, 4, 5] and non-default [3, 4, 6];
4. the recorded states vs SGLang's prefill capture of the same sequences (``SGLangCaptureRunner``, whose layer ids go
   through the same architecture-aware translation) at every position training reads, and a control one layer off.

With ``--kimi-wrapper`` the same random DeepseekV3 is saved inside Kimi-K2.5's multimodal wrapper
(``KimiK25ForConditionalGeneration``: ``text_config`` + a small random vision tower; weights under ``language_model.``),
so the hooks attach where SGLang's Kimi model keeps the text layers (``language_model.model.layers.{i}``).

With ``--target DIR`` the target is a folder instead (e.g. the DeepseekV3 stand-in that ``eaglenest standin-target
--arch deepseek_v3`` writes), and ``--compare-hf N`` also decodes N prompts greedily with transformers on the same
weights: how far SGLang's tokens agree with transformers' shows SGLang computes the folder's function.

    source .gpu/bin/install.sh && python3 benchmarks/gpu_deepseek_capture.py --out $OUT/dscap
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_sglang import states_vs_prefill  # noqa: E402

TOLERANCE = 3e-2  # bf16 kernels of a batched decode vs a prefill differ in rounding
ARCH = "DeepseekV3ForCausalLM"
KIMI = "KimiK25ForConditionalGeneration"
CONTEXT = 2048  # or the target's max_position_embeddings, when shorter (set in main)


def build_model(folder: Path, layers: int = 8, hidden: int = 1024, vocab: int = 4096) -> Path:
    """A random DeepseekV3 with Kimi-K2.5's MLA dims and a small MoE, saved as SGLang loads it."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2048, moe_intermediate_size=512,
        num_hidden_layers=layers, num_attention_heads=64, num_key_value_heads=64, n_shared_experts=1,
        n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=4096, rope_theta=50000.0,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():  # keep the residual stream well scaled across layers (random init otherwise drifts)
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.normal_(0.0, 0.02)
    model.save_pretrained(folder, safe_serialization=True)
    raw = json.loads((folder / "config.json").read_text())
    raw.update({"topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1,
                "architectures": [ARCH], "torch_dtype": "bfloat16"})
    (folder / "config.json").write_text(json.dumps(raw, indent=1))
    return folder


def wrap_as_kimi(text: Path, folder: Path) -> Path:
    """The DeepseekV3 folder inside Kimi-K2.5's wrapper: config.json with ``text_config`` and a small vision config
    (its weights are left out: SGLang keeps the tower's random init, and text prompts never reach it)."""
    from safetensors.torch import load_file, save_file

    folder.mkdir(parents=True, exist_ok=True)
    text_cfg = json.loads((text / "config.json").read_text())
    tensors = {}
    for f in sorted(text.glob("*.safetensors")):
        tensors.update({f"language_model.{k}": v for k, v in load_file(str(f)).items()})
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    vision = {"patch_size": 14, "num_attention_heads": 4, "num_hidden_layers": 1, "hidden_size": 256,
              "intermediate_size": 512, "vt_hidden_size": 256, "text_hidden_size": text_cfg["hidden_size"]}
    wrapper = {"architectures": [KIMI], "model_type": "kimi_k25", "text_config": text_cfg, "vision_config": vision,
               "torch_dtype": "bfloat16", "media_placeholder_token_id": text_cfg["vocab_size"] - 1, "pad_token_id": 0}
    (folder / "config.json").write_text(json.dumps(wrapper, indent=1))
    return folder


def hf_agreement(model: Path, prompts: list[list[int]], sglang_outputs: list[list[int]], max_new: int) -> dict:
    """Greedy tokens from transformers on the same weights vs SGLang's: mean fraction of each answer that agrees
    before the first difference (bf16 near-ties end agreement early on random or barely trained weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.bfloat16).cuda().eval()
    fracs = []
    with torch.no_grad():
        for p, want in zip(prompts, sglang_outputs, strict=True):
            ids = torch.tensor([p], device="cuda")
            out = hf.generate(ids, max_new_tokens=max_new, do_sample=False, min_new_tokens=max_new)[0, len(p):]
            got = out.tolist()
            diff = [i for i, (x, y) in enumerate(zip(got, want, strict=False)) if x != y]
            same = diff[0] if diff else min(len(got), len(want))
            fracs.append(same / max(len(want), 1))
    del hf
    torch.cuda.empty_cache()
    return {"prompts": len(prompts), "mean_agreeing_prefix_fraction": round(sum(fracs) / len(fracs), 3),
            "fully_identical": sum(f == 1.0 for f in fracs)}


def prompts_of(n: int, vocab: int, longest: int = 400) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(7)
    shortest = min(48, longest // 2)
    return [torch.randint(3, vocab, (int(torch.randint(shortest, longest, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def engine_cfg():
    from eaglenest.config import SGLangEngineConfig

    return SGLangEngineConfig(mem_fraction_static=0.45, context_length=CONTEXT, capture="generation",
                              extra_args={"skip_tokenizer_init": True,
                                          # text only: no image processor for the wrapper (it has no processor files)
                                          **({"enable_multimodal": False} if ARCH == KIMI else {})})


def offline(model: Path, prompts: list[list[int]], max_new: int) -> dict:
    from eaglenest.engines.sglang.args import engine_kwargs
    from eaglenest.engines.sglang.symbols import sglang_symbol

    eng = sglang_symbol("sglang:Engine")(**engine_kwargs(str(model), engine_cfg(), dtype="bfloat16"))
    try:
        sp = {"temperature": 0.0, "max_new_tokens": max_new, "ignore_eos": True}
        eng.generate(input_ids=prompts[:16], sampling_params=sp)
        t = time.perf_counter()
        outs = eng.generate(input_ids=prompts, sampling_params=sp)
        secs = time.perf_counter() - t
    finally:
        eng.shutdown()
    n = sum(int(o["meta_info"]["completion_tokens"]) for o in outs)
    return {"tokens": n, "seconds": round(secs, 2), "tokens_per_s": round(n / secs, 1),
            "outputs": [list(o["output_ids"]) for o in outs]}


def recording(model: Path, prompts: list[list[int]], max_new: int, aux: list[int], hidden: int) -> dict:
    from eaglenest.engines.base import CaptureHint, Generation
    from eaglenest.engines.sglang.args import engine_kwargs, generation_capture_kwargs
    from eaglenest.engines.sglang.recorded import GenerationRecorder
    from eaglenest.engines.sglang.symbols import sglang_symbol

    cfg = engine_cfg()
    rec = GenerationRecorder(None, aux, hidden_size=hidden, ring_bytes=int(2 * 2**30), architecture=ARCH)
    rec.sink.start()
    kw = generation_capture_kwargs(engine_kwargs(str(model), cfg, dtype="bfloat16"), rec.hooks)
    eng = sglang_symbol("sglang:Engine")(**kw)
    try:
        sp = {"temperature": 0.0, "max_new_tokens": max_new, "ignore_eos": True}
        warm = rec.new_rids(16)
        rec.sink.discard(warm)
        eng.generate(input_ids=prompts[:16], sampling_params=sp, rid=warm)
        rids = rec.new_rids(len(prompts))
        t = time.perf_counter()
        outs = eng.generate(input_ids=prompts, sampling_params=sp, rid=rids)
        secs = time.perf_counter() - t
        gens = [Generation(token_ids=list(o["output_ids"]), text="", finish_reason="length", prompt_tokens=len(p),
                           meta={"completion_tokens": int(o["meta_info"]["completion_tokens"])})
                for o, p in zip(outs, prompts, strict=True)]
        rec.expect(rids, prompts, gens)
        seqs = [p + g.token_ids for p, g in zip(prompts, gens, strict=True)]
        masks = [[0] * len(p) + [1] * len(g.token_ids) for p, g in zip(prompts, gens, strict=True)]

        def no_prefill(s, r):
            raise RuntimeError(f"{len(s)} sequences lacked recorded rows")

        caps = rec.capture(seqs, [CaptureHint(g.meta["capture_ref"], m) for g, m in zip(gens, masks, strict=True)],
                           prefill=no_prefill)
    finally:
        eng.shutdown()
        line = rec.sink.take_stats().line()
        rec.close()
    n = sum(len(g.token_ids) for g in gens)
    return {"tokens": n, "seconds": round(secs, 2), "tokens_per_s": round(n / secs, 1), "capture": line,
            "seqs": seqs, "masks": masks, "caps": caps, "outputs": [g.token_ids for g in gens]}


def versus_prefill(model: Path, runs: dict[str, dict], layers: int, n_check: int) -> dict:
    from eaglenest.engines.sglang.args import capture_server_kwargs
    from eaglenest.engines.sglang.capture import SGLangCaptureRunner

    runner = SGLangCaptureRunner(capture_server_kwargs(str(model), engine_cfg(), dtype="bfloat16",
                                                       max_total_tokens=16384),
                                 architecture=ARCH, num_layers=layers, max_tokens=4096)
    out = {}
    try:
        for name, r in runs.items():
            aux = r["aux"]
            worst = states_vs_prefill(runner, aux, r["seqs"][:n_check], r["masks"][:n_check], r["caps"][:n_check])
            worst = {k: round(v, 5) for k, v in worst.items()}
            worst["ok"] = worst["aux"] <= TOLERANCE and worst["last"] <= TOLERANCE and worst["control_aux"] > TOLERANCE
            out[name] = {"aux_layer_ids": aux, "sequences_checked": min(n_check, len(r["seqs"])), **worst}
    finally:
        runner.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--check", type=int, default=16, help="sequences compared against the prefill capture")
    ap.add_argument("--target", type=Path, default=None, help="a DeepseekV3 folder (default: build a random one)")
    ap.add_argument("--compare-hf", type=int, default=0, help="prompts also decoded by transformers")
    ap.add_argument("--kimi-wrapper", action="store_true", help="the random target inside Kimi-K2.5's wrapper")
    a = ap.parse_args()
    global ARCH, CONTEXT
    a.out.mkdir(parents=True, exist_ok=True)
    if a.target is None:
        layers, hidden, vocab = 8, 1024, 4096
        model = build_model(Path("/tmp/eaglenest-ds-target"), layers, hidden, vocab)
        if a.kimi_wrapper:
            model, ARCH = wrap_as_kimi(model, Path("/tmp/eaglenest-kimi-target")), KIMI
    else:
        model = a.target
        raw = json.loads((model / "config.json").read_text())
        layers, hidden, vocab = raw["num_hidden_layers"], raw["hidden_size"], raw["vocab_size"]
        if (model / "tokenizer.json").is_file():  # prompts of real tokens: the padded rows are never produced
            from transformers import AutoTokenizer

            vocab = min(vocab, len(AutoTokenizer.from_pretrained(str(model))))
    raw = json.loads((model / "config.json").read_text())
    CONTEXT = min(CONTEXT, int(raw.get("text_config", raw).get("max_position_embeddings") or CONTEXT))
    prompts = prompts_of(a.prompts, vocab, longest=min(400, CONTEXT - a.max_new - 8))
    raw = raw.get("text_config", raw)
    result: dict = {"target": {"architecture": ARCH, "folder": str(model), "layers": layers, "hidden": hidden,
                               **{k: raw.get(k) for k in ("q_lora_rank", "kv_lora_rank", "n_routed_experts",
                                                          "num_experts_per_tok", "n_shared_experts")}}}
    ref = offline(model, prompts, a.max_new)
    result["offline"] = {k: v for k, v in ref.items() if k != "outputs"}
    if a.compare_hf:
        result["sglang_vs_transformers"] = hf_agreement(model, prompts[:a.compare_hf], ref["outputs"][:a.compare_hf],
                                                        a.max_new)
        print(json.dumps({"sglang_vs_transformers": result["sglang_vs_transformers"]}), flush=True)
    default = [2, layers // 2, layers - 3]
    other = [3, layers // 2, layers - 2]
    runs = {}
    for name, aux in (("default_taps", default), ("non_default_taps", other)):
        r = recording(model, prompts, a.max_new, aux, hidden)
        r["aux"] = aux
        runs[name] = r
        same = sum(x == y for x, y in zip(r["outputs"], ref["outputs"], strict=True)) / len(prompts)
        result[f"recording_{name}"] = {"tokens_per_s": r["tokens_per_s"], "seconds": r["seconds"],
                                       "vs_offline": round(r["tokens_per_s"] / ref["tokens_per_s"], 3),
                                       "identical_outputs_fraction": round(same, 3), "capture": r["capture"]}
        print(json.dumps({name: result[f"recording_{name}"]}), flush=True)
    result["states_vs_prefill"] = versus_prefill(model, runs, layers, a.check)
    print(json.dumps(result, indent=1), flush=True)
    (a.out / "deepseek_capture.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0 if all(v["ok"] for v in result["states_vs_prefill"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
