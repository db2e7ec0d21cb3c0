"""The embedded tiny target: a small Llama built deterministically from a seed, with no download.

It is an ordinary Hugging Face model folder (config.json, model.safetensors, tokenizer files with a chat template)
that plain ``AutoModelForCausalLM`` / ``AutoTokenizer`` load, so it exercises exactly the loading code of real targets.
It is briefly pre-trained on the shipped chat corpus so that its continuations depend on the context through its
hidden states, which is what makes the drafter's layer taps testable.

The build is bit-identical on every x86-64 CPU, whatever the thread count, not only from run to run on one machine
(issue #16). Plain float32 training is not: MKL, oneDNN and ATen pick kernels by instruction set (AVX2, AVX-512, AMX)
and thread count, whose roundings differ in the last bit, and training at this learning rate is chaotic (a 1e-16
difference grows to 1e-2 within 60 steps), so the weights and greedy continuations differ between CPU types. So:
the weights are initialised by eaglenest (not transformers' version-dependent init), pre-training runs in float64
through a plain-ops forward (``llama_forward``), and after every step each weight is rounded to a multiple of
``WEIGHT_GRID`` (2^-16). Kernels then differ by ~1e-16 per step (measured: at most 1e-9 of the grid), so the
rounding maps both CPUs' weights to the same values every step and the differences never compound; the stored
float32 weights are those exact multiples. What still decides the bits: the corpus, the tokenizer's BPE training (the
``tokenizers`` package) and this code (``BUILDER_VERSION``). ``weights_digest`` hashes the result; the tests pin it.

Pre-training adds a small penalty on the cosine similarity of adjacent layers' (token-centred) residual states
(``LAYER_DECORRELATION``). Without it, adjacent hidden states of this small model are ~0.97 cosine-similar, so a
drafter fed the wrong layers (off by one) loses almost nothing and no test could see that bug class; with it,
every physical layer carries its own view (adjacent similarity ~0.1) at a small cost in LM loss.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import torch
import torch.nn.functional as F

from eaglenest.config import TinyTargetSpec, default_cache_dir

BUILDER_VERSION = "3"

LAYER_DECORRELATION = 0.5
"""weight of the adjacent-layer similarity penalty in pre-training (see the module docstring)"""

ROPE_THETA = 10000.0
"""RoPE base (Llama's default), set in the config and used by the float64 pre-training forward"""

WEIGHT_GRID = 2.0**-16
"""pre-training keeps every weight a multiple of this (fixed point, exact in float32 below 256; see the docstring)"""

BUILD_THREADS = 4
"""at most this many threads pre-train (the grid makes the result independent of the count; more only costs)"""

INIT_STD = 0.02
"""std of the normal initialisation of every matrix (Llama's ``initializer_range``)"""

SPECIAL_TOKENS = [
    "<|pad|>", "<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>",
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<tools>", "</tools>",
]
EOS_TOKEN = "<|end|>"

# Append-only: rendering a longer conversation never changes the text of a shorter prefix, so regen can extend
# exact token ids turn by turn. The assistant's turn ends with <|end|> (the EOS the model learns to emit).
CHAT_TEMPLATE = (
    "{{ '<|bos|>' }}"
    "{% if tools %}{{ '<|system|><tools>' }}{{ tools | tojson }}{{ '</tools><|end|>' }}{% endif %}"
    "{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>' }}"
    "{% if m['role'] == 'assistant' %}"
    "{% if m.get('reasoning_content') %}{{ '<think>' + m['reasoning_content'] + '</think>' }}{% endif %}"
    "{{ m['content'] or '' }}"
    "{% for tc in (m.get('tool_calls') or []) %}"
    "{% set f = tc['function'] if tc.get('function') else tc %}"
    "{{ '<tool_call>' }}{{ {'name': f['name'], 'arguments': f['arguments']} | tojson }}{{ '</tool_call>' }}"
    "{% endfor %}"
    "{% else %}{{ m['content'] or '' }}{% endif %}"
    "{{ '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def corpus_chats() -> list[dict]:
    """The shipped chats (eaglenest/assets/tiny_corpus.jsonl)."""
    text = resources.files("eaglenest").joinpath("assets/tiny_corpus.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def corpus_ids(tokenizer) -> list[list[int]]:
    """The shipped chats as token ids: what pre-training reads (the tokenizer's whole part in the weights)."""
    from eaglenest.engines.base import render_chat_ids

    return [render_chat_ids(tokenizer, c["messages"], tools=c.get("tools"), add_generation_prompt=False)
            for c in corpus_chats()]


def corpus_ids_digest(tokenizer) -> str:
    """sha256 of :func:`corpus_ids`: tells a changed tokenizer from changed training numerics."""
    return hashlib.sha256(json.dumps(corpus_ids(tokenizer)).encode()).hexdigest()


def spec_key(spec: TinyTargetSpec) -> str:
    """Cache key: the spec and the builder version; changing either builds a new folder."""
    blob = json.dumps({"v": BUILDER_VERSION, **spec.model_dump()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def ensure_tiny_target(spec: TinyTargetSpec | None = None, cache_dir: str | Path | None = None) -> Path:
    """Return the cached tiny target folder for ``spec``, building it once (safe across processes)."""
    spec = spec or TinyTargetSpec()
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    target = root / f"tiny-target-{spec_key(spec)}"
    if (target / "model.safetensors").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f".{target.name}.lock"):
        if not (target / "model.safetensors").is_file():
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
            try:
                build_tiny_target(tmp, spec)
                os.replace(tmp, target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return target


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def build_tokenizer(vocab_size: int, chats: list[dict] | None = None):
    """A byte-level BPE trained on ``chats`` (default: the shipped corpus), wrapped as a transformers fast tokenizer.

    Special tokens and chat template are the tiny target's, so every target built here speaks one chat format.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from eaglenest.engines.base import render_chat_text

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token=EOS_TOKEN, pad_token="<|pad|>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
    )
    fast.chat_template = CHAT_TEMPLATE
    texts = [render_chat_text(fast, c["messages"], tools=c.get("tools"), add_generation_prompt=False)
             for c in (corpus_chats() if chats is None else chats)]
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token=EOS_TOKEN, pad_token="<|pad|>",
        additional_special_tokens=SPECIAL_TOKENS[3:], model_max_length=1 << 20,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_target(out_dir: str | Path, spec: TinyTargetSpec | None = None) -> Path:
    """Build the tiny target into ``out_dir`` (bit-identical for the same spec)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = spec or TinyTargetSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec.vocab_size)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=ROPE_THETA,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(min(threads, BUILD_THREADS))
    try:
        model = LlamaForCausalLM(cfg)
        init_weights(model, spec.seed)
        snap_to_grid(model)
        if spec.train_steps:
            _pretrain(model, corpus_ids(tokenizer), spec)
    finally:
        torch.set_num_threads(threads)
    model.float()  # exact: every weight is a multiple of WEIGHT_GRID
    model.eval()
    model.generation_config.do_sample = False
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "eaglenest_tiny.json").write_text(json.dumps({"builder_version": BUILDER_VERSION, **spec.model_dump()},
                                                        indent=2, sort_keys=True) + "\n")
    return out


def init_weights(model: torch.nn.Module, seed: int) -> None:
    """Llama's initialisation (normal matrices, unit norms) in float64, drawn by name from one seeded generator.

    Not transformers' own: its draw order and float32 sampler (which has an AVX2-only variant) may change with the
    version or the CPU; float64 draws differ at most in the last bit, which snapping to the grid absorbs.
    """
    model.double()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * INIT_STD)


def snap_to_grid(model: torch.nn.Module) -> None:
    """Round every weight to the nearest multiple of ``WEIGHT_GRID`` (see the module docstring for why)."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.round(p / WEIGHT_GRID) * WEIGHT_GRID)


def weights_digest(folder: str | Path) -> str:
    """sha256 of the model's tensors (name, dtype, shape, bytes; sorted by name), independent of file metadata."""
    from safetensors.torch import load_file

    h = hashlib.sha256()
    for name, t in sorted(load_file(str(Path(folder) / "model.safetensors")).items()):
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _pretrain(model, seqs: list[list[int]], spec: TinyTargetSpec, seq_len: int = 64, batch_size: int = 16) -> None:
    """Next-token training (float64) on random windows of the corpus; a fixed RNG makes it reproducible."""
    rng = random.Random(spec.seed)
    stream = [t for s in seqs for t in s]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=spec.train_steps, pct_start=0.1)
    model.train()
    for _ in range(spec.train_steps):
        starts = [rng.randrange(0, len(stream) - seq_len - 1) for _ in range(batch_size)]
        batch = torch.tensor([stream[s:s + seq_len] for s in starts], dtype=torch.long)
        logits, layer_outputs = llama_forward(model, batch)
        lm_loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        loss = lm_loss + LAYER_DECORRELATION * adjacent_layer_similarity(layer_outputs[:-1])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        snap_to_grid(model)
        sched.step()
    model.eval()


def llama_forward(model, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits and each decoder layer's output of a (float64) ``LlamaForCausalLM``, in plain tensor ops, no cache.

    Why not ``model(ids)``: transformers computes RMSNorm and RoPE in float32 whatever the model's dtype, which would
    bring the CPU-dependent float32 roundings back into pre-training (and its attention code changes by version).
    """
    cfg, m = model.config, model.model
    b, t = ids.shape
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = cfg.hidden_size // heads
    inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    angles = torch.outer(torch.arange(t, dtype=torch.float64), inv_freq).repeat(1, 2)
    cos, sin = angles.cos(), angles.sin()
    causal = torch.full((t, t), float("-inf"), dtype=torch.float64).triu(1)

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps))

    def split_heads(x: torch.Tensor, n: int, rope: bool) -> torch.Tensor:  # (b, t, n*hd) -> (b, heads, t, hd)
        x = x.view(b, t, n, hd).transpose(1, 2)
        if rope:
            x = x * cos + torch.cat((-x[..., hd // 2:], x[..., :hd // 2]), dim=-1) * sin
        return x.repeat_interleave(heads // n, dim=1)

    x = m.embed_tokens.weight[ids]
    outputs = []
    for layer in m.layers:
        att, mlp = layer.self_attn, layer.mlp
        h = norm(x, layer.input_layernorm.weight)
        q, k = split_heads(att.q_proj(h), heads, True), split_heads(att.k_proj(h), kv_heads, True)
        probs = torch.softmax(q @ k.transpose(-1, -2) * hd ** -0.5 + causal, dim=-1)
        mixed = probs @ split_heads(att.v_proj(h), kv_heads, False)
        x = x + att.o_proj(mixed.transpose(1, 2).reshape(b, t, -1))
        h = norm(x, layer.post_attention_layernorm.weight)
        x = x + mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h))
        outputs.append(x)
    return model.lm_head(norm(x, m.norm.weight)), outputs


def adjacent_layer_similarity(layer_outputs: list[torch.Tensor]) -> torch.Tensor:
    """Mean squared cosine similarity of adjacent decoder layers' outputs (pass physical ids 1..N-1), token-centred.

    Centring per sequence removes the large constant direction every residual stream carries, so the penalty
    acts on what varies from token to token (what a drafter reads).
    """
    hs = [h - h.mean(dim=1, keepdim=True) for h in layer_outputs]
    sims = [F.cosine_similarity(hs[i], hs[i + 1], dim=-1).pow(2).mean() for i in range(len(hs) - 1)]
    return torch.stack(sims).mean()
