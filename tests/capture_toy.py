"""A CPU stand-in for SGLang's Llama and scheduler, for capture-during-generation tests (no GPU, no sglang).

The model has SGLang's Llama call convention (``model.layers.{i}(positions, hidden, forward_batch, residual) ->
(hidden, residual)``, ``model.norm(hidden, residual) -> (normed, residual)``) and module names, or, with
``Model("deepseek")``, DeepseekV2's (``layer(positions, hidden, forward_batch, residual, zero_allocator, None, None)
-> (hidden, residual, topk_indices)``), and with ``Model("kimi")`` the same under Kimi-K2.5's ``language_model``
wrapper (tests/unit/test_sglang_contract.py checks these conventions against SGLang's source); the scheduler
batches continuously (chunked prefill mixed with other requests' chunks, decode steps with requests joining and
leaving) and hands each forward a batch with the ForwardBatch fields the hooks read.
"""

from __future__ import annotations

import enum
import fnmatch
import importlib
from dataclasses import dataclass, field

import torch
from torch import nn

from eaglenest.engines.base import Generation

H, V, LAYERS = 8, 50, 6
AUX = [1, 3, 4]


class Mode(enum.Enum):
    EXTEND = 1
    DECODE = 2
    IDLE = 3

    def is_extend(self) -> bool:
        return self is Mode.EXTEND

    def is_decode(self) -> bool:
        return self is Mode.DECODE

    def is_idle(self) -> bool:
        return self is Mode.IDLE


@dataclass
class Batch:
    """The ForwardBatch fields the hooks read (names and meaning as in sglang 0.5.14)."""

    forward_mode: Mode
    rids: list[str]
    input_ids: torch.Tensor
    positions: torch.Tensor
    extend_seq_lens_cpu: list[int] | None = None


class Layer(nn.Module):
    """Position-wise, so a sequence's states depend only on its own tokens and positions (no attention needed to
    check attribution): any row filed under the wrong request or position shows up as a mismatch."""

    def __init__(self, i: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(i)
        self.w = nn.Parameter(torch.randn(H, H, generator=g) / H ** 0.5, requires_grad=False)

    def forward(self, positions, hidden, forward_batch, residual):
        if residual is None:
            residual = hidden
        else:
            residual = residual + hidden
        return torch.tanh(residual @ self.w + positions[:, None] * 0.01), residual


class DeepseekLayer(Layer):
    """DeepseekV2DecoderLayer's convention: 7 positional arguments (the 5th a BumpAllocator), a 3-tuple out."""

    def forward(self, positions, hidden, forward_batch, residual, zero_allocator, gemm_output_zero_allocator=None,
                llama_4_scaling=None, prev_topk_indices=None, captured_last_layer_outputs=None):
        assert zero_allocator is not None
        h, r = super().forward(positions, hidden, forward_batch, residual)
        return h, r, None


class Norm(nn.Module):
    def forward(self, hidden, residual):
        x = hidden + residual
        return x / x.norm(dim=-1, keepdim=True), x


class Inner(nn.Module):
    def __init__(self, deepseek: bool = False) -> None:
        super().__init__()
        self.deepseek = deepseek
        self.embed = nn.Embedding(V, H)
        self.layers = nn.ModuleList((DeepseekLayer if deepseek else Layer)(i) for i in range(LAYERS))
        self.norm = Norm()

    def forward(self, fb: Batch):
        h, r = self.embed(fb.input_ids), None
        for layer in self.layers:
            if self.deepseek:
                h, r, _ = layer(fb.positions, h, fb, r, object(), None, None)
            else:
                h, r = layer(fb.positions, h, fb, r)
        return self.norm(h, r)[0]

    def reference(self, ids: list[int]) -> torch.Tensor:
        """[T, 3H + H] aux streams at AUX + final normed state of one teacher-forced sequence."""
        pos = torch.arange(len(ids))
        h, r = self.embed(torch.tensor(ids)), None
        streams = [h]
        for layer in self.layers:
            h, r = Layer.forward(layer, pos, h, None, r)
            streams.append(h + r)
        return torch.cat([streams[k] for k in AUX] + [self.norm(h, r)[0]], dim=-1)


class Model(nn.Module):
    """``arch``: "llama" (``model.layers``), "deepseek" (same paths, DeepseekV2's layer call) or "kimi" (DeepseekV2's
    layers under ``language_model.model``, as SGLang's KimiK25ForConditionalGeneration holds them)."""

    def __init__(self, arch: str = "llama") -> None:
        super().__init__()
        torch.manual_seed(0)
        inner = Inner(deepseek=arch in ("deepseek", "kimi"))
        if arch == "kimi":
            self.language_model = nn.Module()
            self.language_model.model = inner
        else:
            self.model = inner

    def __getattr__(self, name: str):
        if name == "model" and "language_model" in self._modules:
            return self._modules["language_model"].model  # an alias, not a module path (as in SGLang's Kimi class)
        return super().__getattr__(name)


def attach(model: nn.Module, specs: list[dict]) -> None:
    """What sglang's register_forward_hooks does with server_args.forward_hooks."""
    names = dict(model.named_modules())
    for spec in specs:
        mod_name, fn = spec["hook_factory"].split(":")
        hook = getattr(importlib.import_module(mod_name), fn)(spec["config"])
        matched = [m for n, m in names.items() if any(fnmatch.fnmatch(n, p) for p in spec["target_modules"])]
        assert matched, spec
        for m in matched:
            m.register_forward_hook(hook)


@dataclass
class Req:
    rid: str
    ids: list[int]
    prompt_len: int
    max_new: int
    computed: int = 0
    out: list[int] = field(default_factory=list)


class Scheduler:
    """A toy continuous batcher: prefill in chunks of ``chunk`` tokens (mixed with other requests' chunks), then
    decode one token per step; the next token is a fixed function of the last logits' argmax."""

    def __init__(self, model: Model, chunk: int = 4) -> None:
        self.model, self.chunk = model, chunk

    def step(self, reqs: list[Req]) -> None:
        pre = [r for r in reqs if r.computed < r.prompt_len]
        if pre:
            segs = [(r, r.computed, min(r.prompt_len, r.computed + self.chunk)) for r in pre]
            ids = [t for r, a, b in segs for t in r.ids[a:b]]
            pos = [p for _, a, b in segs for p in range(a, b)]
            fb = Batch(Mode.EXTEND, [r.rid for r, _, _ in segs], torch.tensor(ids), torch.tensor(pos),
                       [b - a for _, a, b in segs])
        else:
            live = [r for r in reqs if len(r.out) < r.max_new]
            fb = Batch(Mode.DECODE, [r.rid for r in live], torch.tensor([r.ids[-1] for r in live]),
                       torch.tensor([len(r.ids) - 1 for r in live]))
            segs = [(r, len(r.ids) - 1, len(r.ids)) for r in live]
        normed = self.model.model(fb)
        row = 0
        for r, a, b in segs:
            r.computed = max(r.computed, b)
            row += b - a
            if b == len(r.ids) and len(r.out) < r.max_new:  # the last row of a request samples its next token
                tok = int(normed[row - 1].abs().argmax()) * 5 % V + 1
                r.out.append(tok)
                r.ids.append(tok)

    def generate(self, prompts: list[list[int]], max_new: list[int], rids: list[str]) -> list[Generation]:
        reqs = [Req(rid, list(p), len(p), n) for rid, p, n in zip(rids, prompts, max_new, strict=True)]
        active: list[Req] = []
        pending = list(reqs)
        while pending or active:
            if pending:  # one request joins per step: batch composition changes all the time
                active.append(pending.pop(0))
            self.step(active)
            active = [r for r in active if len(r.out) < r.max_new]
        return [Generation(token_ids=r.out, text="", finish_reason="length", prompt_tokens=r.prompt_len,
                           meta={"completion_tokens": len(r.out)}) for r in reqs]
