"""The embedded tiny target: a small Llama built deterministically from a seed, with no download.

It is an ordinary Hugging Face model folder (config.json, model.safetensors, tokenizer files with a chat template)
that plain ``AutoModelForCausalLM`` / ``AutoTokenizer`` load, so it exercises exactly the loading code of real targets.
It is briefly pre-trained (single-threaded, deterministic) on the shipped chat corpus so that its continuations
depend on the context through its hidden states, which is what makes the drafter's layer taps testable.

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

from eaglenest.config import TinyTargetSpec

BUILDER_VERSION = "2"

LAYER_DECORRELATION = 0.5
"""weight of the adjacent-layer similarity penalty in pre-training (see the module docstring)"""

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


def spec_key(spec: TinyTargetSpec) -> str:
    """Cache key: the spec and the builder version; changing either builds a new folder."""
    blob = json.dumps({"v": BUILDER_VERSION, **spec.model_dump()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def default_cache_dir() -> Path:
    return Path(os.environ.get("EAGLENEST_CACHE", Path.home() / ".cache" / "eaglenest"))


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

    from eaglenest.engines.base import render_chat_ids

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
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: same reduction order, same bits on every build
    try:
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(cfg).float()
        if spec.train_steps:
            chats = corpus_chats()
            seqs = [render_chat_ids(tokenizer, c["messages"], tools=c.get("tools"), add_generation_prompt=False)
                    for c in chats]
            _pretrain(model, seqs, spec, tokenizer.pad_token_id)
    finally:
        torch.set_num_threads(threads)
    model.eval()
    model.generation_config.do_sample = False
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "eaglenest_tiny.json").write_text(json.dumps({"builder_version": BUILDER_VERSION, **spec.model_dump()},
                                                        indent=2, sort_keys=True) + "\n")
    return out


def _pretrain(model, seqs: list[list[int]], spec: TinyTargetSpec, pad_id: int, seq_len: int = 64,
              batch_size: int = 16) -> None:
    """Next-token training on random windows of the corpus; a fixed RNG makes it reproducible."""
    rng = random.Random(spec.seed)
    stream = [t for s in seqs for t in s]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=spec.train_steps, pct_start=0.1)
    model.train()
    for _ in range(spec.train_steps):
        starts = [rng.randrange(0, len(stream) - seq_len - 1) for _ in range(batch_size)]
        batch = torch.tensor([stream[s:s + seq_len] for s in starts], dtype=torch.long)
        out = model(input_ids=batch, labels=batch, output_hidden_states=True)
        loss = out.loss + LAYER_DECORRELATION * adjacent_layer_similarity(out.hidden_states)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    model.eval()


def adjacent_layer_similarity(hidden_states) -> torch.Tensor:
    """Mean squared cosine similarity of adjacent decoder layers' outputs (physical ids 1..N-1), token-centred.

    Centring per sequence removes the large constant direction every residual stream carries, so the penalty
    acts on what varies from token to token (what a drafter reads).
    """
    hs = [h - h.mean(dim=1, keepdim=True) for h in hidden_states[1:-1]]
    sims = [torch.nn.functional.cosine_similarity(hs[i], hs[i + 1], dim=-1).pow(2).mean() for i in range(len(hs) - 1)]
    return torch.stack(sims).mean()
