"""What the speculative decoder needs from a draft model, and the draft models it can use.

* :class:`Eagle3DraftModel` wraps an :class:`~drafter.model.Eagle3Drafter` and decides which target states feed it:
  ``eagle3`` (the drafter's recorded physical aux layers: correct), ``off_by_one`` (every aux layer id + 1: the
  layer-numbering bug) or ``eagle`` (what SGLang does under ``--speculative-algorithm EAGLE`` with an EAGLE-3
  checkpoint: the target's final normed state goes in, ``fc`` is skipped, the target's ``lm_head`` rows
  ``[:draft_vocab_size]`` replace the drafter's head and ``d2t`` is ignored).
* :class:`TargetSelfDraft` drafts with the target model itself (its own KV cache; with greedy decoding every draft
  token is accepted, so accept length = num_steps + 1: the upper bound a drafter can reach).
* :class:`RandomDraft` proposes uniformly random tokens (accept length ~ 1: the lower bound).

Row convention (EAGLE): draft row ``t`` reads the feature of position ``t`` and the token at ``t + 1`` and predicts
the token at ``t + 2``; its RoPE position is ``t``. The decoder owns slot validity; a draft model only appends one
cache slot per input row and applies the ``allowed [B, S, L + S]`` mask it is given.
"""

from __future__ import annotations

import abc
from typing import Any, Literal

import torch
import torch.nn.functional as F

from eaglenest.drafters.eagle3.model import Eagle3Drafter
from eaglenest.engines.hf_compat import cache_kwargs, new_dynamic_cache
from eaglenest.speculative.cache import additive_mask, commit_block, select_rows, truncate

FeedMode = Literal["eagle3", "off_by_one", "eagle"]
FEED_MODES: tuple[str, ...] = ("eagle3", "off_by_one", "eagle")


class DraftModel(abc.ABC):
    """A drafter as the speculative decoder sees it."""

    feature: Literal["aux", "final", "none"] = "none"
    """which target states it reads: the concatenated aux layers, the final normed state, or nothing"""
    feature_layers: list[int] | None = None
    """physical ids (``hidden_states`` index) of the aux layers, when ``feature == "aux"``"""
    token_map: torch.Tensor | None = None
    """``[Vd]`` target id of each draft-vocab index; None = identity"""

    @abc.abstractmethod
    def new_cache(self, first_tokens: torch.Tensor) -> Any:
        """An empty cache for a batch; ``first_tokens [B]`` is each prompt's first token."""

    @abc.abstractmethod
    def step(
        self,
        cache: Any,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        allowed: torch.Tensor,
        *,
        own_hidden: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``S`` rows; returns draft-vocab logits ``[B, S, Vd]`` and the hidden output ``[B, S, Hd]``.

        ``hidden`` is the target feature (``own_hidden=False``) or this model's previous hidden output.
        """

    # cache bookkeeping (slot numbering is the decoder's; subclasses with extra slots override)
    def truncate(self, cache: Any, length: int) -> None:
        truncate(cache, length)

    def commit(self, cache: Any, start: int, index: torch.Tensor) -> None:
        commit_block(cache, start, index)

    def select_rows(self, cache: Any, rows: torch.Tensor) -> None:
        select_rows(cache, rows)


class Eagle3DraftModel(DraftModel):
    """An EAGLE-3 drafter fed the way ``mode`` says (see the module docstring)."""

    def __init__(
        self,
        drafter: Eagle3Drafter,
        *,
        mode: FeedMode = "eagle3",
        target_num_layers: int | None = None,
        target_lm_head: torch.Tensor | None = None,
        aux_layer_ids: list[int] | None = None,
    ) -> None:
        if mode not in FEED_MODES:
            raise ValueError(f"unknown drafter feed mode {mode!r}; choose one of {FEED_MODES}")
        cfg = drafter.config
        self.drafter = drafter
        self.dtype = drafter.embed_tokens.weight.dtype
        self.mode = mode
        n_layers = target_num_layers or cfg.target_num_layers
        if target_num_layers is not None and cfg.target_num_layers and cfg.target_num_layers != target_num_layers:
            raise ValueError(
                f"the drafter was trained for a {cfg.target_num_layers}-layer target, this target has "
                f"{target_num_layers} layers; train a drafter for this target"
            )
        self.head_weight: torch.Tensor | None = None
        if mode == "eagle":
            if target_lm_head is None:
                raise ValueError("mode 'eagle' replaces the drafter's lm_head by the target's: pass target_lm_head")
            if cfg.hidden_size != cfg.target_hidden_size:
                raise ValueError(
                    f"mode 'eagle' feeds the target's {cfg.target_hidden_size}-dim final state straight into a "
                    f"drafter of hidden size {cfg.hidden_size}; they must be equal"
                )
            self.feature = "final"
            self.feature_layers = None
            self.head_weight = target_lm_head[: cfg.draft_vocab_size]
            self.token_map = None  # d2t ignored: draft index i is target id i
        else:
            base = list(aux_layer_ids or cfg.aux_layer_ids)
            layers = [i + 1 for i in base] if mode == "off_by_one" else base
            bad = [i for i in layers if not 1 <= i <= n_layers]
            if bad:
                raise ValueError(f"aux layer ids {layers} do not fit a {n_layers}-layer target (1..{n_layers})")
            self.feature = "aux"
            self.feature_layers = layers
            self.token_map = drafter.draft_target_ids()

    def new_cache(self, first_tokens: torch.Tensor) -> Any:
        return self.drafter.new_cache()

    def step(self, cache, input_ids, hidden, position_ids, allowed, *, own_hidden):
        fused = not (own_hidden or self.mode == "eagle")
        logits, out = self.drafter.step(input_ids, hidden.to(self.dtype), position_ids, cache,
                                        attention_mask=allowed, fused=fused)
        if self.head_weight is not None:
            logits = F.linear(self.drafter.norm(out), self.head_weight.to(out.dtype))
        return logits, out


class TargetSelfDraft(DraftModel):
    """The target proposing its own tokens (an exact drafter for greedy decoding; a test and calibration tool).

    It keeps its own KV cache with one extra leading slot holding each prompt's first token, because EAGLE rows
    start one token late (row ``t`` carries token ``t + 1``).
    """

    feature = "none"

    def __init__(self, target_model: Any) -> None:
        self.model = target_model
        self.decoder = target_model.get_decoder() if hasattr(target_model, "get_decoder") else target_model.model
        self.lm_head = target_model.get_output_embeddings()
        self.dtype = next(target_model.parameters()).dtype
        self.token_map = None

    @torch.inference_mode()
    def new_cache(self, first_tokens: torch.Tensor) -> Any:
        cache = new_dynamic_cache(self.model.config)
        b = first_tokens.shape[0]
        allowed = torch.ones(b, 1, 1, dtype=torch.bool, device=first_tokens.device)
        self.decoder(input_ids=first_tokens[:, None], position_ids=torch.zeros_like(first_tokens)[:, None],
                     attention_mask=additive_mask(allowed, self.dtype), use_cache=True,
                     **cache_kwargs(self.decoder, cache))
        return cache

    @torch.inference_mode()
    def step(self, cache, input_ids, hidden, position_ids, allowed, *, own_hidden):
        b, s = input_ids.shape
        prefix = torch.ones(b, s, 1, dtype=torch.bool, device=allowed.device)
        mask = additive_mask(torch.cat([prefix, allowed], dim=2), self.dtype)
        out = self.decoder(input_ids=input_ids, position_ids=position_ids + 1, attention_mask=mask, use_cache=True,
                           **cache_kwargs(self.decoder, cache))
        h = out.last_hidden_state
        return self.lm_head(h), h[..., :1]

    def truncate(self, cache, length):
        truncate(cache, length + 1)

    def commit(self, cache, start, index):
        commit_block(cache, start + 1, index)


class RandomDraft(DraftModel):
    """Uniformly random proposals from a seeded generator (no cache, no features)."""

    feature = "none"

    def __init__(self, vocab_size: int, seed: int = 0, device: str | torch.device = "cpu") -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.token_map = None

    def new_cache(self, first_tokens):
        return None

    def step(self, cache, input_ids, hidden, position_ids, allowed, *, own_hidden):
        b, s = input_ids.shape
        logits = torch.rand(b, s, self.vocab_size, generator=self.generator).to(self.device) * 4.0
        return logits, torch.zeros(b, s, 1, device=self.device)
