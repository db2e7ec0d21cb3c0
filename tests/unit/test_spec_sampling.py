"""Rejection sampling keeps the target's distribution (statistical test on a tiny-vocabulary Llama).

The target: a randomly initialised 2-layer Llama over 8 tokens with a sharpened head (peaked, context-dependent
next-token distributions). The exact joint distribution of its first three sampled tokens is enumerated (512
outcomes). 6000 requests (one batch, each with its own seeded RNG) are decoded speculatively with a drafter whose
proposals differ from the target (an untrained EAGLE-3 drafter over a 6-token draft vocab with a non-trivial
``d2t``; a random proposer), as a chain (sampled drafts, ``min(1, p/q)``) and as a tree (point-mass top-k drafts).

Test: Pearson chi-square of the observed joint counts against the exact probabilities (cells with expected count
< 5 pooled), p-value from the chi-square survival function. Tolerance: p > 1e-3 passes. The seeds are fixed, so
the outcome is deterministic; a negative control (plain sampling at temperature 1.3 tested against the
temperature-1.0 distribution) must fail the same test, which shows the test has the power to see a wrong sampler.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from eaglenest.config import SpecConfig
from eaglenest.drafters.eagle3.model import DrafterModelConfig, Eagle3Drafter
from eaglenest.engines.base import SamplingParams
from eaglenest.speculative.decoder import BaselineDecoder, SpecDecoder
from eaglenest.speculative.draft import RandomDraft

VOCAB = 8
N_SAMPLES = 6000
LENGTH = 3
PROMPT = [1, 4, 2, 7]
ALPHA = 1e-3


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t7")


@pytest.fixture(scope="module")
def small_vocab_target():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # peaked, prompt-dependent distributions instead of near-uniform ones
    return model, _tokenizer()


def _drafter(model) -> Eagle3Drafter:
    torch.manual_seed(5)
    cfg = DrafterModelConfig(
        hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=64,
        vocab_size=VOCAB, draft_vocab_size=6, aux_layer_ids=[1, 2, 3], target_hidden_size=32, target_num_layers=4)
    d = Eagle3Drafter(cfg)
    ids = torch.tensor([0, 2, 3, 5, 6, 7])
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[ids] = True
    d.init_from_target(model.get_input_embeddings().weight, model.lm_head.weight * 0.5,
                       ids - torch.arange(6), t2d)
    return d.eval()


@torch.no_grad()
def _exact_joint(model, temperature: float) -> torch.Tensor:
    """p(x1, x2, x3 | PROMPT) for every outcome, from the target's logits (teacher forcing all 512 prefixes)."""
    seqs = torch.tensor([PROMPT + list(t) for t in itertools.product(range(VOCAB), repeat=LENGTH)])
    logits = model(input_ids=seqs).logits[:, len(PROMPT) - 1: len(PROMPT) - 1 + LENGTH].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    chosen = logp.gather(-1, seqs[:, len(PROMPT):, None])[..., 0]
    return chosen.sum(-1).exp().double()


def _counts(results) -> torch.Tensor:
    counts = torch.zeros(VOCAB ** LENGTH, dtype=torch.float64)
    for r in results:
        assert len(r.token_ids) == LENGTH
        idx = 0
        for t in r.token_ids:
            idx = idx * VOCAB + t
        counts[idx] += 1
    return counts


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells with expected count < 5 are pooled into one."""
    n = counts.sum()
    expected = probs / probs.sum() * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2.0))


def _sample(decoder, temperature: float, seed: int):
    prompts = [PROMPT] * N_SAMPLES
    return decoder.generate(prompts, SamplingParams(temperature=temperature, max_new_tokens=LENGTH, seed=seed))


@pytest.mark.parametrize(
    "draft,spec",
    [
        ("eagle3", SpecConfig(num_steps=3, topk=1, num_draft_tokens=4)),
        ("eagle3", SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)),
        ("random", SpecConfig(num_steps=2, topk=3, num_draft_tokens=5)),
    ],
    ids=["eagle3-chain", "eagle3-tree", "random-tree"],
)
def test_speculative_sampling_matches_target_distribution(small_vocab_target, draft, spec):
    model, tok = small_vocab_target
    drafter = _drafter(model) if draft == "eagle3" else RandomDraft(VOCAB, seed=2)
    dec = SpecDecoder(model, tok, drafter, spec, eos_token_ids=())
    results = _sample(dec, 1.0, seed=11)
    p = chi_square_pvalue(_counts(results), _exact_joint(model, 1.0))
    accepted = sum(sum(r.accepted_per_step) for r in results)
    assert accepted > N_SAMPLES * 0.05, "the drafter must get some tokens accepted, else only the bonus path is tested"
    assert p > ALPHA, f"speculative samples deviate from the target distribution (chi-square p = {p:.2e})"


def test_plain_sampling_matches_and_wrong_temperature_is_detected(small_vocab_target):
    """The same test accepts plain sampling at T=1 and rejects sampling at T=1.3 (the test can fail)."""
    model, tok = small_vocab_target
    base = BaselineDecoder(model, tok, eos_token_ids=())
    exact = _exact_joint(model, 1.0)
    assert chi_square_pvalue(_counts(_sample(base, 1.0, seed=11)), exact) > ALPHA
    assert chi_square_pvalue(_counts(_sample(base, 1.3, seed=11)), exact) < ALPHA
