#!/usr/bin/env python3
"""Does training help? Held-out acc_k and simulated accept length of the drafter before and after TTT training.

Trains the tiny target's drafter on CPU with ``eaglenest train``'s own code path (Ray Train, Ray Data shards) and
prints the held-out metrics of the untrained drafter (step 0: target embedding and lm_head rows, random midlayer)
next to the trained one, from the same run and the same held-out samples.

    python benchmarks/drafter_training.py                      # regenerates 480 chats with the tiny target first
    python benchmarks/drafter_training.py --data out/demo/regen  # or train on a regen output folder

Results: OUT/results.json (+ OUT/train/metrics.jsonl, training_curves.png, export/).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build_shards(out: Path, samples: int, max_new_tokens: int) -> Path:
    """Target-native data: the tiny target regenerates each chat's last answer (greedy), then it is captured."""
    from eaglenest.config import TargetConfig
    from eaglenest.drafter.quick_shards import chat_samples, write_quick_shards
    from eaglenest.engines.hf import HFEngine
    from eaglenest.engines.tiny import corpus_chats

    if (out / "manifest.json").is_file():
        print(f"reusing shards in {out}")
        return out
    t = time.time()
    engine = HFEngine.from_config(TargetConfig(model="tiny", device="cpu", dtype="float32"))
    chats = corpus_chats()[:samples]
    data = chat_samples(engine, chats, regenerate=True, max_new_tokens=max_new_tokens, batch_size=32)
    manifest = write_quick_shards(engine, data, out, dtype="bfloat16", rows_per_shard=64)
    print(f"built {manifest.num_samples} samples / {manifest.num_tokens} tokens ({manifest.num_loss_tokens} "
          f"target-generated) in {time.time() - t:.0f}s -> {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="out/bench-drafter-training")
    ap.add_argument("--data", default=None, help="a regen output folder (default: build shards from the corpus)")
    ap.add_argument("--samples", type=int, default=480)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--draft-vocab", type=int, default=512)
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args(argv)
    for k, v in {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
                 "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"}.items():
        os.environ.setdefault(k, v)

    from eaglenest.config import EaglenestConfig
    from eaglenest.drafter.driver import train_drafter

    out = Path(args.out).resolve()
    data = Path(args.data).resolve() if args.data else build_shards(out / "shards", args.samples,
                                                                     args.max_new_tokens)
    cfg = EaglenestConfig.model_validate({
        "target": {"model": "tiny", "device": "cpu", "dtype": "float32"},
        "train": {
            "drafter": {"draft_vocab_size": args.draft_vocab}, "ttt_steps": args.ttt_steps,
            "batch_size": args.batch_size, "max_steps": args.steps, "learning_rate": args.lr, "warmup_ratio": 0.05,
            "eval_fraction": 0.15, "eval_every": max(1, args.steps // 4), "eval_max_samples": 128,
            "checkpoint_every": args.steps, "log_every": max(1, args.steps // 12), "run_name": "bench",
            "cpus_per_worker": 2.0,
        },
    })
    t = time.time()
    summary = train_drafter(cfg, data, out / "train")
    wall = time.time() - t
    before, after = summary["first_eval"], summary["final_eval"]
    if before is None or before["step"] != 0:
        print("the run resumed from a checkpoint: delete OUT/train for a before/after comparison", file=sys.stderr)
        return 1
    keys = ["sim_accept_length"] + [f"acc_{k}" for k in range(args.ttt_steps)] + ["loss_0"]
    print(f"\nheld-out ({int(after['tokens'])} supervised positions at step 0), draft vocab "
          f"{summary['draft_vocab_size']} of the target's tokens (covers {100 * summary['vocab_coverage']:.1f}%)")
    print(f"{'metric':>20} | {'untrained (step 0)':>18} | {'trained (step ' + str(after['step']) + ')':>18}")
    for k in keys:
        print(f"{k:>20} | {before[k]:>18.3f} | {after[k]:>18.3f}")
    print(f"training wall time {wall:.0f}s for {after['step']} steps (batch {args.batch_size}, K {args.ttt_steps}) "
          f"including Ray start-up; train samples {summary['train_samples']}, held-out {summary['eval_samples']}")
    res = {"untrained": before, "trained": after, "wall_s": wall, "args": vars(args), "summary": summary}
    (out / "results.json").write_text(json.dumps(res, indent=2) + "\n")
    print(f"results: {out / 'results.json'}; curves: {summary['plot']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
