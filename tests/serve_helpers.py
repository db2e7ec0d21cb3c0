"""For the serve and preflight tests: small drafter folders written by the real exporter (random weights), and a
client that streams through a swap."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import openai


def tiny_target_facts(target: Path) -> dict[str, Any]:
    return json.loads((Path(target) / "config.json").read_text())


def make_drafter(out: Path, target: Path, *, aux_layer_ids: tuple[int, int, int] = (2, 4, 5), hidden: int | None = None,
                 draft_vocab: int = 512, seed: int = 0, max_position_embeddings: int | None = None) -> Path:
    """Export a randomly initialised EAGLE-3 drafter for ``target`` (float32) with eaglenest.drafter.export."""
    import torch

    from eaglenest.drafter.export import export_drafter
    from eaglenest.drafters.eagle3.model import DrafterModelConfig, Eagle3Drafter

    t = tiny_target_facts(target)
    h = hidden or int(t["hidden_size"])
    cfg = DrafterModelConfig(
        hidden_size=h, num_attention_heads=4, num_key_value_heads=2, head_dim=h // 4, intermediate_size=2 * h,
        vocab_size=int(t["vocab_size"]), draft_vocab_size=draft_vocab, aux_layer_ids=list(aux_layer_ids),
        target_hidden_size=h, target_num_layers=int(t["num_hidden_layers"]), target=str(target),
        max_position_embeddings=max_position_embeddings or int(t.get("max_position_embeddings", 2048)),
    )
    torch.manual_seed(seed)
    model = Eagle3Drafter(cfg)
    if h == int(t["hidden_size"]):  # the drafter's frozen embedding is the target's (preflight samples it)
        from eaglenest.contracts.target import TargetSpec

        embed, _ = TargetSpec.read(target).load_embed_and_head()
        with torch.no_grad():
            model.embed_tokens.weight.copy_(embed)
    # a non-trivial vocab mapping (a random sorted subset of the target vocab), so d2t is not all zeros
    ids = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(seed))[:draft_vocab].sort().values
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    model.set_vocab_mapping(ids - torch.arange(draft_vocab), t2d)
    return export_drafter(model, out, dtype="float32")


def rewrite_tensors(folder: Path, fn) -> None:
    """Load the export's tensors, apply ``fn(dict) -> dict``, write them back (safetensors)."""
    from safetensors.torch import load_file, save_file

    f = Path(folder) / "model.safetensors"
    tensors = fn(dict(load_file(str(f))))
    save_file(tensors, str(f), metadata={"format": "pt"})


class StreamingClient:
    """Streams greedy chat requests in a loop and checks each answer against the target's own greedy answer."""

    def __init__(self, url: str, cases: list[tuple[list[dict], str]]) -> None:
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        self.cases, self.ok, self.errors, self.mismatches = cases, 0, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            messages, want = self.cases[i % len(self.cases)]
            i += 1
            try:
                chunks = self.client.chat.completions.create(model="eaglenest", messages=messages, temperature=0,
                                                             max_tokens=40, stream=True)
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                self.ok += 1
                if text != want:
                    self.mismatches.append((messages[-1]["content"], text, want))
            except Exception as e:  # every failure counts: a swap must cause none
                self.errors.append(repr(e))
            time.sleep(0.2)

    def __enter__(self) -> StreamingClient:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(120)
