"""Capture check on CUDA in bf16: a randomly initialised ~1B-parameter Llama built on the spot.

Same assertions as tests/component/test_engine_hf.py (capture == transformers' own output_hidden_states at the
physical ids, final normed state reproduces the logits, batched == one at a time, out-of-range ids refused), at a size
where bf16 kernels and batching differ from the CPU path. Needs only torch + transformers (no Ray):

    python benchmarks/gpu_capture.py --device cuda --json $OUT/gpu_capture.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_sglang import rel_err  # noqa: E402
from eaglenest.contracts.layers import LayerIdError, default_aux_layer_ids  # noqa: E402
from eaglenest.engines.hf import HFEngine  # noqa: E402


class _IdTokenizer:
    """Enough of a tokenizer for capture (pad id, EOS); the token ids are drawn directly."""

    pad_token_id = 0
    eos_token_id = 1
    eos_token = "</s>"
    chat_template = None


def build_model(device: str, dtype: torch.dtype, size: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    shapes = {
        "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
                   num_key_value_heads=8, vocab_size=32000),
        "small": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1000),
    }[size]
    cfg = LlamaConfig(max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=1, pad_token_id=0,
                      **shapes)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype)
    return model.eval()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", default="1b", choices=["1b", "small"])
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    t0 = time.perf_counter()
    model = build_model(args.device, dtype, args.size)
    n_params = sum(p.numel() for p in model.parameters())
    engine = HFEngine(model, _IdTokenizer(), model_name=f"random-llama-{args.size}")
    layer_ids = default_aux_layer_ids(engine.info.num_layers)
    g = torch.Generator().manual_seed(1)
    lengths = [37, 64, 129, 200]
    seqs = [torch.randint(2, engine.info.vocab_size, (n,), generator=g).tolist() for n in lengths]
    caps = engine.capture(seqs, layer_ids)
    worst_exact = worst_logit = worst_batch = 0.0
    neighbour = float("inf")
    for seq, cap in zip(seqs, caps, strict=True):
        with torch.no_grad():
            out = model(input_ids=torch.tensor([seq], device=args.device), output_hidden_states=True)
            logits = model.lm_head(cap.last_hidden_state.to(args.device)).cpu()
        want = torch.cat([out.hidden_states[i][0] for i in layer_ids], -1).cpu()
        # one sequence alone runs exactly the kernels of transformers' own forward: the values must be identical
        single = engine.capture([seq], layer_ids)[0]
        worst_exact = max(worst_exact, rel_err(single.aux_hidden_states, want))
        worst_logit = max(worst_logit, rel_err(model.lm_head(single.last_hidden_state.to(args.device)).cpu(),
                                               out.logits[0].cpu()))
        # inside a padded batch the bf16 kernels differ (masked attention): same values within bf16 rounding
        worst_batch = max(worst_batch, rel_err(cap.aux_hidden_states, single.aux_hidden_states),
                          rel_err(logits, out.logits[0].cpu()))
        # control: the neighbouring layer is far away, so the tolerance cannot hide an off-by-one tap
        wrong = torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], -1).cpu()
        neighbour = min(neighbour, rel_err(wrong, want))
    refused = False
    try:
        engine.capture(seqs[:1], [2, 8, engine.info.num_layers + 1])
    except LayerIdError:
        refused = True
    exact_tol = 1e-6
    batch_tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
    result = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "dtype": str(dtype), "params": n_params, "layers": engine.info.num_layers, "aux_layer_ids": layer_ids,
        "rel_err_single_vs_hidden_states": worst_exact, "rel_err_logits_from_last_state": worst_logit,
        "exact_tolerance": exact_tol,
        "rel_err_batched_vs_single": worst_batch, "batched_tolerance": batch_tol,
        "rel_err_neighbour_layer_control": neighbour, "out_of_range_refused": refused,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    result["passed"] = bool(worst_exact <= exact_tol and worst_logit <= exact_tol and worst_batch <= batch_tol
                            and neighbour > 5 * batch_tol and refused)
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
