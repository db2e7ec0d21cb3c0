"""The GPU stand-in target: a real language model, pre-trained here on real chat text, grown to an 8B-class shape.

Why it exists: a speculative-decoding result means something only on a target whose step costs what a real model's
does and whose outputs are a real language model's (learnable, not random). No model can be downloaded on the lent
GPU, so this builds one, the way the embedded tiny target is built but at GPU scale:

1. read a public ShareGPT dump as it is (a JSON array, possibly cut short: the records before the cut are used);
2. train a byte-level BPE with the tiny target's special tokens and chat template on part of it;
3. pre-train a small Llama (default 12 layers, hidden 1024, ~0.2B parameters) on the chats for a fixed number of
   steps from a seed (bf16 autocast on a GPU; a few minutes on an H200);
4. grow it function-preservingly (``eaglenest.engines.widen``) to Llama-3-8B's shape (hidden 4096, 32 layers,
   GQA 32/8, intermediate 14336; ~7B parameters): SGLang then pays an 8B model's memory traffic per decode step
   while the tokens are those of the small model;
5. write prompt files from records that are disjoint from each other: ``train.jsonl`` (ShareGPT records for
   ``eaglenest regen``) and ``heldout.jsonl`` (for ``eaglenest bench`` / ``eval``), both first exchanges only; the
   held-out records are also kept out of pre-training.

What it is not: a capable assistant. Its answers are fluent-ish ShareGPT-style text from a few minutes of
pre-training, often repetitive, which makes them easier to draft than a frontier model's; docs/GPU_STANDIN.md says
what that means for the numbers measured on it.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eaglenest.contracts.sharegpt import sharegpt_record, speaker_role
from eaglenest.engines.base import render_chat_ids, render_chat_text
from eaglenest.engines.pretrain import LossFn, PretrainPlan, lm_loss, pretrain_lm
from eaglenest.engines.widen import WideShape, count_parameters, widen_config, widen_state_dict

CHAT_ROLES = ("user", "assistant")
"""The roles pre-training keeps; other speakers (system, tool, unknown names) end a record's usable part."""


@dataclass(frozen=True)
class StandinSpec:
    """Everything that decides the stand-in's weights (with the dump's bytes)."""

    vocab_size: int = 32000
    hidden_size: int = 1024
    num_layers: int = 12
    num_heads: int = 8  # head_dim 128, as the wide shape's
    intermediate_size: int = 2816
    max_position_embeddings: int = 4096
    seq_len: int = 1024
    batch_size: int = 32
    train_steps: int = 700
    learning_rate: float = 2e-3
    warmup_steps: int = 60
    seed: int = 0
    tokenizer_chats: int = 6000
    heldout_records: int = 1000
    max_seconds: float | None = None
    """stop pre-training early past this (a time budget; the report then says so, and the LR the run ended at, and
    the weights depend on the machine's speed)"""
    wide: WideShape = field(default_factory=WideShape)


@dataclass
class DumpRead:
    """Records read from a JSON-array dump, and where (if anywhere) it was damaged."""

    records: list[dict]
    damage: str | None = None


def read_json_array(path: str | Path) -> DumpRead:
    """Every intact element of a JSON array file; a cut or broken tail ends the read with a reason (never raises).

    Public dumps are often truncated (a partial download, a size cap): the elements before the damage are kept.
    """
    raw = Path(path).read_bytes()
    text = raw.decode("utf-8-sig", errors="replace")
    dec = json.JSONDecoder()
    i = _skip_ws(text, 0)
    if i >= len(text) or text[i] != "[":
        return DumpRead([], f"{path}: not a JSON array (first character {text[i:i + 1]!r})")
    i = _skip_ws(text, i + 1)
    records: list[dict] = []
    while i < len(text):
        if text[i] == "]":
            return DumpRead(records)
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            return DumpRead(records, f"{path}: damaged after element {len(records)} (char {e.pos}): {e.msg}")
        if isinstance(obj, dict):
            records.append(obj)
        i = _skip_ws(text, i)
        if i < len(text) and text[i] == ",":
            i = _skip_ws(text, i + 1)
    return DumpRead(records, f"{path}: ends without ']' after element {len(records)} (truncated)")


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def chat_of(record: dict) -> list[dict[str, str]]:
    """A ShareGPT record's usable chat: leading non-user turns dropped, cut at the first empty or unknown turn."""
    turns = record.get("conversations") or []
    messages: list[dict[str, str]] = []
    for t in turns:
        role = speaker_role(t.get("from", "")) if isinstance(t, dict) else None
        role = role if role in CHAT_ROLES else None
        value = t.get("value") if isinstance(t, dict) else None
        if not messages and role == "assistant":
            continue
        if role is None or not isinstance(value, str) or not value.strip():
            break
        if messages and messages[-1]["role"] == role:
            break  # two turns of one speaker: the record's structure is off from here on
        messages.append({"role": role, "content": value})
    return messages


@dataclass
class Corpus:
    """A dump read and tokenized for pre-training: records, chats, the held-out cut, the tokenizer, the stream."""

    read: DumpRead
    chats: list[list[dict[str, str]]]
    split: int
    """records before it are for pre-training and regen prompts; the held-out part starts here"""
    tokenizer: Any
    stream: torch.Tensor
    """every pre-training chat rendered with the chat template, concatenated (int32 token ids)"""

    def heldout_chats(self, n: int) -> list[list[dict[str, str]]]:
        return [c for c in self.chats[self.split:] if c][:n]


def prepare_corpus(dump: str | Path, *, vocab_size: int, tokenizer_chats: int, heldout_records: int,
                   report: dict[str, Any], log: Callable[[str], None] = print) -> Corpus:
    """Read the dump, cut the held-out tail, train the BPE on part of the rest, tokenize it (fills ``report``)."""
    from eaglenest.engines.tiny import build_tokenizer

    t0 = time.perf_counter()
    read = read_json_array(dump)
    chats = [chat_of(r) for r in read.records]
    split = max(0, len(read.records) - heldout_records)
    train_chats = [c for c in chats[:split] if c]
    report["dump_read"] = {"records": len(read.records), "damage": read.damage, "usable_train_chats":
                           len(train_chats), "seconds": round(time.perf_counter() - t0, 1)}
    log(f"standin: {len(read.records)} records read ({read.damage or 'intact'}); {len(train_chats)} chats for "
        "pre-training")
    if not train_chats:
        raise ValueError(f"{dump}: no usable ShareGPT chats before the held-out part")

    t = time.perf_counter()
    os.environ["TOKENIZERS_PARALLELISM"] = "true"  # this process only tokenizes here; use every core
    tokenizer = build_tokenizer(vocab_size, [{"messages": c} for c in train_chats[:tokenizer_chats]])
    texts = [render_chat_text(tokenizer, c, add_generation_prompt=False) for c in train_chats]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    stream = torch.from_numpy(np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32))
    report["tokenizer"] = {"vocab": len(tokenizer), "pretrain_tokens": int(stream.numel()),
                           "seconds": round(time.perf_counter() - t, 1)}
    log(f"standin: tokenizer {len(tokenizer)} tokens; corpus {stream.numel():,} tokens")
    return Corpus(read, chats, split, tokenizer, stream)


def write_generation_config(folder: Path, tokenizer: Any) -> None:
    """Greedy by default, with the tokenizer's special ids."""
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
         "pad_token_id": tokenizer.pad_token_id, "do_sample": False}, indent=2) + "\n")


def build_standin(dump: str | Path, out_dir: str | Path, spec: StandinSpec | None = None, *,
                  device: str = "cuda", num_train_prompts: int = 2048, num_heldout_prompts: int = 128,
                  max_prompt_tokens: int = 192, train_after_cut: int = 0,
                  log: Callable[[str], None] = print) -> dict[str, Any]:
    """Build the stand-in into ``out_dir`` (``model/``: the wide target, ``base/``: the small one, ``prompts/``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = spec or StandinSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"spec": asdict(spec), "dump": str(dump)}
    t0 = time.perf_counter()
    corpus = prepare_corpus(dump, vocab_size=spec.vocab_size, tokenizer_chats=spec.tokenizer_chats,
                            heldout_records=spec.heldout_records, report=report, log=log)
    read, chats, split, tokenizer, stream = corpus.read, corpus.chats, corpus.split, corpus.tokenizer, corpus.stream

    small_cfg = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_heads,
        head_dim=spec.hidden_size // spec.num_heads, max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(small_cfg).float().to(device)
    report["pretrain"] = pretrain(model, stream, spec, device, log)
    model.eval()
    base = out / "base"
    model.save_pretrained(base, safe_serialization=True)
    tokenizer.save_pretrained(base)

    t = time.perf_counter()
    wide_dir = out / "model"
    wide_dir.mkdir(parents=True, exist_ok=True)
    wcfg = widen_config(small_cfg.to_dict(), spec.wide)
    dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32  # fp32 on CPU: exact check
    wcfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    sd = widen_state_dict({k: v.detach() for k, v in model.state_dict().items()}, small_cfg.to_dict(), spec.wide,
                          dtype=dtype, device=device)
    report["preservation"] = preservation_check(model, sd, wcfg, tokenizer, [c for c in chats[split:] if c][:8],
                                                device)
    from safetensors.torch import save_file

    save_file({k: v.contiguous().cpu() for k, v in sd.items()}, str(wide_dir / "model.safetensors"),
              metadata={"format": "pt"})
    del sd
    (wide_dir / "config.json").write_text(json.dumps(wcfg, indent=2, sort_keys=True) + "\n")
    tokenizer.save_pretrained(wide_dir)
    write_generation_config(wide_dir, tokenizer)
    report["wide"] = {"parameters": count_parameters(wcfg), "base_parameters": count_parameters(small_cfg.to_dict()),
                      "seconds": round(time.perf_counter() - t, 1), "path": str(wide_dir)}
    log(f"standin: widened to {report['wide']['parameters'] / 1e9:.2f}B parameters "
        f"(max logit difference {report['preservation']['max_abs_logit_diff']:.3g}, top-1 agreement "
        f"{report['preservation']['top1_agreement']:.4f})")

    report["prompts"] = write_prompt_files(read.records, split, tokenizer, out / "prompts", num_train_prompts,
                                           num_heldout_prompts, max_prompt_tokens, train_after_cut=train_after_cut)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    (out / "standin.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    return report


def pretrain(model: Any, stream: torch.Tensor, spec: StandinSpec, device: str,
             log: Callable[[str], None] = print, *, loss_fn: LossFn = lm_loss) -> dict[str, Any]:
    """The shared pre-training loop (``engines.pretrain``) with the spec's steps, batch and schedule."""
    plan = PretrainPlan(train_steps=spec.train_steps, batch_size=spec.batch_size, seq_len=spec.seq_len,
                        learning_rate=spec.learning_rate, warmup_steps=spec.warmup_steps, seed=spec.seed,
                        max_seconds=spec.max_seconds)
    return pretrain_lm(model, stream, plan, device, loss_fn=loss_fn, log=log, name="standin pretrain")


@torch.no_grad()
def preservation_check(small: Any, wide_sd: dict[str, torch.Tensor], wide_cfg: dict, tokenizer: Any,
                       chats: list[list[dict]], device: str) -> dict[str, Any]:
    """Logits of the small model vs the wide one (the widened weights, as transformers runs them) on held-out chats."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{k: v for k, v in wide_cfg.items() if k != "torch_dtype"})
    dtype = next(iter(wide_sd.values())).dtype
    with torch.device(device):
        wide = LlamaForCausalLM._from_config(cfg, torch_dtype=dtype)
    wide.load_state_dict(wide_sd, assign=True, strict=True)
    wide.eval()
    diffs, agree, total = [], 0, 0
    for c in chats or [[{"role": "user", "content": "Hello there, how are you today?"}]]:
        ids = render_chat_ids(tokenizer, c, add_generation_prompt=False)[:256]
        x = torch.tensor([ids], device=device)
        a = small(input_ids=x).logits.float()
        b = wide(input_ids=x).logits.float()
        diffs.append(float((a - b).abs().max()))
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += a.shape[1]
    del wide
    return {"max_abs_logit_diff": max(diffs), "top1_agreement": agree / max(total, 1), "tokens": total}


def first_exchange(record: dict) -> list[dict[str, str]] | None:
    """The record's first user turn and the answer to it (the answer is regenerated by the target anyway)."""
    chat = chat_of(record)
    return chat[:2] if len(chat) >= 2 else None


def write_prompt_files(records: list[dict], split: int, tokenizer: Any, out: Path, n_train: int, n_heldout: int,
                       max_prompt_tokens: int, *, train_after_cut: int = 0) -> dict[str, Any]:
    """``train.jsonl`` (ShareGPT records, regen's input) from records before ``split``; ``heldout.jsonl`` (bench
    prompts) from records after it. First exchanges whose prompt fits ``max_prompt_tokens``, in dump order, no
    prompt twice.

    ``train_after_cut``: up to this many of the train prompts come from the records after the cut that follow the
    held-out ones (other conversations the stand-in never pre-trained on, like the bench's), the rest from before
    it; so the drafter's data covers both kinds of prompt the bench can meet, and the held-out prompts stay unseen.
    """
    out.mkdir(parents=True, exist_ok=True)

    seen: set[str] = set()  # public dumps repeat prompts; regen would drop the repeats as duplicates

    def pick(rs: Iterator[tuple[int, dict]], n: int) -> list[tuple[int, dict, list[dict]]]:
        got = []
        for i, r in rs:
            ex = first_exchange(r)
            if ex is None or ex[0]["content"].strip() in seen:
                continue
            seen.add(ex[0]["content"].strip())
            n_tok = len(render_chat_ids(tokenizer, ex[:1], add_generation_prompt=True))
            if 8 <= n_tok <= max_prompt_tokens:
                got.append((i, r, ex))
                if len(got) >= n:
                    break
        return got

    after = iter([(i + split, r) for i, r in enumerate(records[split:])])
    held = pick(after, n_heldout)
    late = pick(after, min(train_after_cut, n_train)) if train_after_cut > 0 else []
    train = pick(iter(enumerate(records[:split])), n_train - len(late)) + late
    with (out / "train.jsonl").open("w") as f:
        for i, r, ex in train:
            f.write(json.dumps(sharegpt_record(r.get("id", f"record-{i}"), ex[:2])) + "\n")
    with (out / "heldout.jsonl").open("w") as f:
        for i, r, ex in held:
            f.write(json.dumps({"id": r.get("id", f"record-{i}"), "domain": "chat", "messages": ex[:1]}) + "\n")
    rng = random.Random(0)
    sample = rng.sample(held, min(3, len(held)))
    return {"train": len(train), "train_after_cut": len(late), "heldout": len(held),
            "train_path": str(out / "train.jsonl"),
            "heldout_path": str(out / "heldout.jsonl"), "max_prompt_tokens": max_prompt_tokens,
            "heldout_examples": [ex[0]["content"][:120] for _, _, ex in sample]}
