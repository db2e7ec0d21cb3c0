"""Reference EAGLE-3 speculative decoding on a transformers target (any device), and the plain baseline.

Public API::

    from eaglenest.speculative import SpecDecoder, BaselineDecoder, SpecResult, StreamChunk
    from eaglenest.config import SpecConfig
    from eaglenest.engines.base import SamplingParams

    dec = SpecDecoder(target_model, tokenizer, drafter, SpecConfig(num_steps=3, topk=1, num_draft_tokens=4))
    # or: SpecDecoder.from_engine(hf_engine, drafter, spec)     (hf_engine: eaglenest.engines.hf.HFEngine)
    results: list[SpecResult] = dec.generate([prompt_ids, ...], SamplingParams(temperature=0, max_new_tokens=64))
    for chunk in dec.stream(prompt_ids, sampling):       # one chunk per target forward
        chunk.token_ids       # new tokens (1 + accepted drafts, cut at EOS / max tokens / stop strings)
        chunk.accepted        # draft tokens accepted in this step (None for the prefill token)
        chunk.finished, chunk.finish_reason, chunk.result   # result: the SpecResult, on the last chunk

    base = BaselineDecoder(target_model, tokenizer)      # same interface, same loop, no drafter

Incremental API (``generate``/``stream`` run on it; a continuous-batching server drives it directly, adding rows
at step boundaries with :func:`eaglenest.speculative.batching.merge_batches`)::

    rows = {7: DecodeRow(prompt=ids)}                     # the caller's table: row id -> DecodeRow
    batch, chunks = dec.prefill(rows, sampling)            # first token of each row: [(row id, StreamChunk)]
    while batch is not None:
        chunks = dec.step(batch, rows, sampling, number)   # one draft -> verify -> commit of every row
        batch = dec.drop_finished(batch, rows)             # finished (or ``rows[i].cancel()``-ed) rows leave

``drafter`` is an :class:`~drafter.model.Eagle3Drafter`, a :class:`~eaglenest.speculative.draft.DraftModel`
(e.g. ``TargetSelfDraft``, ``RandomDraft``) or None (baseline). ``mode`` picks what feeds an Eagle3Drafter:
``"eagle3"`` (default; ``spec.algorithm == "EAGLE"`` selects ``"eagle"``), ``"off_by_one"`` or ``"eagle"`` (see
:mod:`eaglenest.speculative.draft`).

:class:`SpecResult` per request: ``token_ids``, ``text``, ``finish_reason`` ("stop" | "length"),
``prompt_tokens``, ``draft_steps`` (target verify forwards after prefill), ``accepted_per_step`` (draft tokens
accepted at each), ``accept_length`` = mean over steps of (accepted + 1): tokens per target forward counting the
bonus token, SGLang's ``spec_accept_length`` definition; 1.0 means no draft token was ever accepted),
``draft_time_s``, ``verify_time_s``, ``prefill_time_s``, ``total_time_s``. In a batch, phase times are the wall time
of the batched phases the request took part in.

How one step works: the drafter expands a tree (chain when ``topk == 1``) from the last emitted token; the target
verifies every node in ONE forward with a tree attention mask over its KV cache; the longest accepted path plus
the target's bonus token is emitted; rejected slots are dropped from both KV caches and the drafter re-reads the
accepted positions with the target's aux hidden states (taken from the same verify forward via
``output_hidden_states`` at the drafter's physical layer ids). Greedy output equals the target's greedy output
token for token; at temperature > 0 rejection sampling keeps the target's distribution
(:mod:`eaglenest.speculative.sampling`). Batches are ragged: each row accepts its own number of tokens; the caches keep
per-row slot validity (:mod:`eaglenest.speculative.cache`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from eaglenest.config import SpecConfig
from eaglenest.drafters.eagle3.model import Eagle3Drafter
from eaglenest.engines.base import SamplingParams
from eaglenest.engines.hf_compat import cache_kwargs, new_dynamic_cache
from eaglenest.kernels import pack_linears, uses_packed_linears
from eaglenest.speculative.backlog import Block, catch_up, select_backlog
from eaglenest.speculative.cache import additive_mask, block_mask, causal_block, commit_block, select_rows
from eaglenest.speculative.draft import DraftModel, Eagle3DraftModel, FeedMode
from eaglenest.speculative.guide import ChainGuide, GuideCompiler, next_token_masks
from eaglenest.speculative.logits import context_mask, penalize, penalize_tree, token_logprobs
from eaglenest.speculative.records import DecodeBatch, DecodeRow, SpecResult, StreamChunk
from eaglenest.speculative.sampling import Acceptance, accept_greedy, accept_sampling, target_probs
from eaglenest.speculative.tree import DraftTree, build_tree, root_only

Policy = Callable[[int], SpecConfig | None]
"""batch size -> draft shape of a step (None: that step does not draft): how a tuned schedule drives the decoder"""


class SpecDecoder:
    """Speculative decoding with an EAGLE-3 drafter (or any :class:`DraftModel`); None = plain decoding."""

    def __init__(
        self,
        target_model: Any,
        tokenizer: Any,
        drafter: Eagle3Drafter | DraftModel | None,
        spec: SpecConfig | None = None,
        *,
        mode: FeedMode | None = None,
        eos_token_ids: Sequence[int] | None = None,
        policy: Policy | None = None,
        guided_drafting: bool = True,
    ) -> None:
        self.model = target_model
        self.tokenizer = tokenizer
        self.spec = spec or SpecConfig()
        self.decoder = target_model.get_decoder() if hasattr(target_model, "get_decoder") else target_model.model
        self.lm_head = target_model.get_output_embeddings()
        p = next(target_model.parameters())
        self.device, self.dtype = p.device, p.dtype
        cfg = getattr(target_model.config, "text_config", None) or target_model.config
        self.num_layers = int(cfg.num_hidden_layers)
        if mode is None:
            mode = "eagle" if self.spec.algorithm == "EAGLE" else "eagle3"
        self.mode = mode
        if isinstance(drafter, Eagle3Drafter):
            drafter = drafter.to(self.device).eval()
            if uses_packed_linears(target_model):  # same kernel for drafter and target; a copy: it may still train
                drafter, _ = pack_linears(drafter, inplace=False)
            draft: DraftModel | None = Eagle3DraftModel(
                drafter, mode=mode, target_num_layers=self.num_layers, target_lm_head=self.lm_head.weight)
        else:
            draft = drafter
        self.draft = draft
        if draft is not None and draft.token_map is not None:
            draft.token_map = draft.token_map.to(self.device)
        self.eos = set(eos_token_ids) if eos_token_ids is not None else _eos_ids(target_model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.policy = policy
        """batch size -> the draft shape of a step (None: the step does not draft); None: always ``spec``"""
        self.last_mode: tuple[int, int] | None = None
        """(batch size, num_steps) of the latest step; num_steps 0 = it did not draft"""
        self._guides: GuideCompiler | None = None
        self.guided_drafting = guided_drafting
        """structured output: a draft chain proposes under the row's grammar, and a tree step with a constrained row
        drafts as a chain (False: both draft free, for comparisons)"""

    @classmethod
    def from_engine(cls, engine: Any, drafter: Eagle3Drafter | DraftModel | None, spec: SpecConfig | None = None,
                    **kwargs: Any) -> SpecDecoder:
        """Build on an :class:`~eaglenest.engines.hf.HFEngine` (its model, tokenizer and EOS ids)."""
        kwargs.setdefault("eos_token_ids", engine.info.eos_token_ids)
        return cls(engine.model, engine.tokenizer, drafter, spec, **kwargs)

    # ------------------------------------------------------------------------------------------------ public
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[SpecResult]:
        """Decode every prompt (one batch); results in prompt order."""
        results: list[SpecResult | None] = [None] * len(prompts)
        for row, chunk in self._run(prompts, sampling):
            if chunk.result is not None:
                results[row] = chunk.result
        return [r for r in results if r is not None]

    def stream(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Iterator[StreamChunk]:
        """Decode one prompt, yielding the tokens of every target forward as soon as they are known."""
        for _, chunk in self._run([prompt_ids], sampling):
            yield chunk

    # The incremental API (what generate/stream run on, and what a continuous-batching server drives):
    #   batch, chunks = dec.prefill(new_rows, sampling)        # step 0: one forward for the new rows
    #   batch = merge_batches(running, batch)                   # eaglenest.speculative.batching
    #   chunks = dec.step(batch, rows, sampling, number)        # one draft -> verify -> commit of the whole batch
    #   batch = dec.drop_finished(batch, rows)                  # finished / cancelled rows leave (None: empty)
    @torch.inference_mode()
    def prefill(self, rows: Mapping[int, DecodeRow],
                sampling: SamplingParams) -> tuple[DecodeBatch | None, list[tuple[int, StreamChunk]]]:
        """One target (and drafter) forward over the prompts of ``rows`` (row id -> new row, in batch order):
        every row emits its first token (a ``step=0`` chunk each, in row order); returns the batch of the rows still
        decoding (None when all finished) and the ``(row id, chunk)`` list."""
        if not rows:
            return None, []
        if any(len(r.prompt) == 0 for r in rows.values()):
            raise ValueError("empty prompt: every prompt needs at least one token")
        ids = list(rows)
        table = [rows[i] for i in ids]
        t0 = self.clock()
        for r in table:
            r.start = t0
            if r.constraint is None:
                r.constraint = sampling.constraint
            if r.constraint is not None and r.guide is None:
                r.guide = self.guides.guide(r.constraint)
        batch, first = self._prefill(table, sampling)
        batch.rows = ids
        t1 = self.clock()
        chunks: list[tuple[int, StreamChunk]] = []
        for i, (rid, r) in enumerate(zip(ids, table, strict=True)):
            r.prefill_s = t1 - t0
            took = self._emit(r, [int(first[i])], sampling)
            chunks.append((rid, self._chunk(r, took, 0, None, sampling)))
        return self.drop_finished(batch, rows), chunks

    @torch.inference_mode()
    def step(self, batch: DecodeBatch, rows: Mapping[int, DecodeRow], sampling: SamplingParams,
             number: int) -> list[tuple[int, StreamChunk]]:
        """One draft -> verify -> commit step of ``batch`` (``rows``: a table holding every row id of the batch);
        one ``(row id, chunk)`` per row that emitted, ``chunk.step == number``. A row finished before the step began
        (cancelled while in the batch) is decoded along but emits nothing. With a ``policy`` the live batch size
        picks this step's draft shape, or no drafting at all (a plain decoding step; the drafter catches up when
        drafting resumes, :mod:`eaglenest.speculative.backlog`). While a row of the batch is constrained (structured
        output), a tree shape drafts as the chain of its depth (:func:`chain_of`)."""
        spec = self.spec_for(len(batch.rows))
        if spec is not None and spec.topk > 1 and self.guided_drafting \
                and any(rows[ri].guide is not None for ri in batch.rows):
            spec = chain_of(spec)  # a tree drafts free and is rejected under a grammar; a chain drafts under it
        self.last_mode = (len(batch.rows), spec.num_steps if spec is not None else 0)
        return [(ri, self._chunk(r, took, number, accepted, sampling))
                for ri, r, took, accepted in self._step(batch, rows, sampling, spec) if took is not None]

    def spec_for(self, batch_size: int) -> SpecConfig | None:
        """The draft shape of a step at ``batch_size`` (None: no drafting)."""
        if self.draft is None:
            return None
        return self.spec if self.policy is None else self.policy(batch_size)

    @torch.inference_mode()
    def drop_finished(self, batch: DecodeBatch, rows: Mapping[int, DecodeRow]) -> DecodeBatch | None:
        """The batch without its finished rows (caches compacted in place); None when no row is left."""
        keep = [j for j, ri in enumerate(batch.rows) if rows[ri].finish is None]
        if not keep:
            return None
        if len(keep) == len(batch.rows):
            return batch
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        select_rows(batch.t_cache, idx)
        batch.rows = [batch.rows[j] for j in keep]
        batch.t_valid = batch.t_valid[idx]
        batch.next_pos = batch.next_pos[idx]
        batch.pending = batch.pending[idx]
        batch.gens = [batch.gens[j] for j in keep]
        if self.draft is not None:
            batch.backlog = select_backlog(batch.backlog, idx)
            self.draft.select_rows(batch.d_cache, idx)
            batch.d_valid = batch.d_valid[idx]
            batch.root_logits = batch.root_logits[idx]
            batch.root_hidden = batch.root_hidden[idx]
        return batch

    @property
    def guides(self) -> GuideCompiler:
        """Structured output's grammar compiler for this target (made on the first constrained row)."""
        if self._guides is None:
            self._guides = GuideCompiler(self.tokenizer, self.lm_head.weight.shape[0], self.eos)
        return self._guides

    def clock(self) -> float:
        """``time.perf_counter()`` once the device finished its queued work: phase timings of a GPU are real."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    # --------------------------------------------------------------------------------------------- internals
    def _target(self, ids: torch.Tensor, pos: torch.Tensor, allowed: torch.Tensor, cache: Any,
                logits_cols: slice | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One target forward; returns logits (of ``logits_cols``) and the drafter's features for every column."""
        want = self.draft.feature if self.draft is not None else "none"
        out = self.decoder(input_ids=ids, position_ids=pos, attention_mask=additive_mask(allowed, self.dtype),
                           use_cache=True, output_hidden_states=want == "aux", **cache_kwargs(self.decoder, cache))
        last = out.last_hidden_state
        logits = self.lm_head(last if logits_cols is None else last[:, logits_cols]).float()
        feats = None
        if want == "aux":
            feats = torch.cat([out.hidden_states[i] for i in self.draft.feature_layers], dim=-1)
        elif want == "final":
            feats = last
        return logits, feats

    def _choose(self, logits: torch.Tensor, sampling: SamplingParams, gens: list) -> torch.Tensor:
        if sampling.greedy:
            return logits.argmax(-1)
        probs = target_probs(logits, sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p).cpu()
        out = [int(torch.multinomial(probs[i], 1, generator=gens[i]).item()) for i in range(probs.shape[0])]
        return torch.tensor(out, dtype=torch.long, device=self.device)

    def _emit(self, row: DecodeRow, new: list[int], sampling: SamplingParams) -> list[int]:
        """Append tokens until a stop; returns what was appended and sets ``row.finish``."""
        took = []
        for tok in new:
            row.tokens.append(tok)
            took.append(tok)
            at_eos = tok in self.eos and not sampling.ignore_eos
            if row.guide is not None and not at_eos:
                row.guide.advance(tok)
                at_eos = row.guide.done  # the answer is complete: only an end token could follow
            if at_eos or (sampling.stop and _hits_stop(self.tokenizer, row.tokens, sampling.stop)):
                row.finish = "stop"
            elif len(row.tokens) >= sampling.max_new_tokens:
                row.finish = "length"
            if row.finish:
                break
        return took

    def _result(self, row: DecodeRow, sampling: SamplingParams) -> SpecResult:
        text = self.tokenizer.decode(row.tokens, skip_special_tokens=True)
        reason = row.finish or "length"
        for s in sampling.stop:
            cut = text.find(s)
            if cut >= 0:
                text, reason = text[:cut], "stop"
        return SpecResult(
            token_ids=list(row.tokens), text=text, finish_reason=reason, prompt_tokens=len(row.prompt),
            draft_steps=len(row.accepted), accepted_per_step=list(row.accepted), draft_tokens=row.proposed,
            draft_time_s=row.draft_s,
            verify_time_s=row.verify_s, prefill_time_s=row.prefill_s, total_time_s=row.end - row.start,
        )

    def _run(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> Iterator[tuple[int, StreamChunk]]:
        """``generate``/``stream``: one fixed batch through prefill, then steps until every row finished."""
        rows = {i: DecodeRow(prompt=list(p)) for i, p in enumerate(prompts)}
        batch, chunks = self.prefill(rows, sampling)
        yield from chunks
        number = 0
        while batch is not None:
            number += 1
            yield from self.step(batch, rows, sampling, number)
            batch = self.drop_finished(batch, rows)

    def _step(self, batch: DecodeBatch, rows: Mapping[int, DecodeRow], sampling: SamplingParams,
              spec: SpecConfig | None) -> list[tuple[int, DecodeRow, list[int] | None, int]]:
        """One draft -> verify -> commit step of ``batch``; per row: (row id, row, tokens it emitted, draft tokens
        accepted). A row already finished when the step began (cancelled while in the batch) was decoded along
        but emits nothing: its tokens are ``None``."""
        t0 = self.clock()
        if spec is not None:
            catch_up(self.draft, batch)
            tree = self._draft_tree(batch, sampling, spec, rows)
        else:
            tree = root_only(batch.pending)
        t1 = self.clock()
        acc, feats, lt = self._verify(batch, tree, sampling, rows)
        t2 = self.clock()
        out: list[tuple[int, DecodeRow, list[int] | None, int]] = []
        for j, ri in enumerate(batch.rows):
            r = rows[ri]
            r.draft_s += t1 - t0
            r.verify_s += t2 - t1
            accepted = len(acc.paths[j]) - 1
            if r.finish is not None:
                out.append((ri, r, None, accepted))
                continue
            if spec is not None or self.draft is None:  # the baseline counts every step; "off" steps drafted nothing
                r.accepted.append(accepted)
                r.proposed += tree.size - 1
            new = [int(tree.tokens[j, c]) for c in acc.paths[j][1:]] + [acc.bonus[j]]
            out.append((ri, r, self._emit(r, new, sampling), accepted))
        self._commit(batch, tree, acc, feats, lt, rows, drafting=spec is not None)
        t3 = self.clock()
        for _, r, _, _ in out:
            r.draft_s += t3 - t2
        return out

    def _chunk(self, r: DecodeRow, took: list[int], step: int, accepted: int | None,
               sampling: SamplingParams) -> StreamChunk:
        result = None
        if r.finish:
            r.end = self.clock()
            result = self._result(r, sampling)
        lps = None if r.step_logprobs is None else r.step_logprobs[:len(took)]
        r.step_logprobs = None
        return StreamChunk(token_ids=took, step=step, accepted=accepted, finished=r.finish is not None,
                           finish_reason=result.finish_reason if result else None, result=result, logprobs=lps)

    def _prefill(self, rows: Sequence[DecodeRow], sampling: SamplingParams) -> tuple[DecodeBatch, torch.Tensor]:
        b = len(rows)
        longest = max(len(r.prompt) for r in rows)
        ids = torch.full((b, longest), self.pad_id, dtype=torch.long)
        valid = torch.zeros((b, longest), dtype=torch.bool)
        for i, r in enumerate(rows):  # left padding: every row's next token sits in the last column
            ids[i, longest - len(r.prompt):] = torch.tensor(r.prompt, dtype=torch.long)
            valid[i, longest - len(r.prompt):] = True
        ids, valid = ids.to(self.device), valid.to(self.device)
        pos = (valid.long().cumsum(-1) - 1).clamp(min=0)
        allowed = causal_block(valid)
        cache = new_dynamic_cache(self.model.config)
        gens = [_row_generator(sampling.seed, i) for i in range(b)]
        logits, feats = self._target(ids, pos, allowed, cache, logits_cols=slice(longest - 1, longest))
        raw = logits[:, -1]
        scored = raw
        if sampling.repetition_penalty != 1.0:
            seen = context_mask([r.prompt for r in rows], raw.shape[-1], raw.device)
            scored = penalize(raw, seen, sampling.repetition_penalty)
        if any(r.guide is not None for r in rows):
            fits = next_token_masks([r.guide for r in rows], scored.shape[-1])
            scored = scored.masked_fill(~fits.to(scored.device), float("-inf"))
        first = self._choose(scored, sampling, gens)
        if sampling.logprobs is not None:
            for i, r in enumerate(rows):
                r.step_logprobs = token_logprobs(raw[i:i + 1], [int(first[i])], sampling.logprobs)
        batch = DecodeBatch(rows=list(range(b)), t_cache=cache, t_valid=valid, next_pos=pos[:, -1] + 1,
                       pending=first, gens=gens)
        if self.draft is not None:
            firsts = torch.tensor([r.prompt[0] for r in rows], dtype=torch.long, device=self.device)
            batch.d_cache = self.draft.new_cache(firsts)
            inp = torch.cat([ids[:, 1:], first[:, None]], dim=1)
            d_feats = feats if feats is not None else torch.zeros(b, longest, 1, device=self.device)
            d_logits, d_hidden = self.draft.step(batch.d_cache, inp, d_feats, pos, allowed, own_hidden=False)
            batch.d_valid = valid
            batch.root_logits, batch.root_hidden = d_logits[:, -1], d_hidden[:, -1]
        return batch, first.cpu()

    def _draft_tree(self, batch: DecodeBatch, sampling: SamplingParams, spec: SpecConfig,
                    rows: Mapping[int, DecodeRow]) -> DraftTree:
        draft = self.draft
        assert draft is not None and batch.d_valid is not None
        ld = batch.d_valid.shape[1]
        b = len(batch.rows)

        def step(tokens: torch.Tensor, parent_hidden: torch.Tensor, level: int, block: torch.Tensor):
            pos = (batch.next_pos + level - 2)[:, None].expand_as(tokens)
            past = batch.d_valid[:, None, :].expand(b, tokens.shape[1], ld)
            return draft.step(batch.d_cache, tokens, parent_hidden, pos, torch.cat([past, block], dim=2),
                              own_hidden=True)

        guides = [rows[ri].guide for ri in batch.rows]
        chain = ChainGuide(guides, draft.token_map, self.lm_head.weight.shape[0]) \
            if self.guided_drafting and spec.topk == 1 and any(g is not None for g in guides) else None
        try:
            tree = build_tree(
                pending=batch.pending, root_logits=batch.root_logits, root_hidden=batch.root_hidden, step=step,
                token_map=draft.token_map, num_steps=spec.num_steps, topk=spec.topk, num_nodes=spec.num_draft_tokens,
                temperature=sampling.temperature, generators=batch.gens, chain_mask=chain,
            )
        finally:
            if chain is not None:
                chain.release()
        draft.truncate(batch.d_cache, ld)  # the speculative slots are re-read from target states after verify
        return tree

    def _verify(self, batch: DecodeBatch, tree: DraftTree, sampling: SamplingParams,
                rows: Mapping[int, DecodeRow]):
        lt = batch.t_valid.shape[1]
        pos = batch.next_pos[:, None] + tree.depth
        allowed = block_mask(batch.t_valid, tree.ancestors)
        raw, feats = self._target(tree.tokens, pos, allowed, batch.t_cache)
        logits = raw
        if sampling.repetition_penalty != 1.0:
            contexts = [rows[ri].prompt + rows[ri].tokens for ri in batch.rows]
            logits = penalize_tree(raw, contexts, tree.tokens, tree.ancestors, sampling.repetition_penalty)
        guided = [(j, rows[ri].guide) for j, ri in enumerate(batch.rows) if rows[ri].guide is not None]
        if guided:
            fits = torch.ones(logits.shape, dtype=torch.bool)
            tokens, parents = tree.tokens.cpu().tolist(), tree.parents.cpu().tolist()
            for j, guide in guided:
                fits[j] = guide.tree_masks(tokens[j], parents[j])
            logits = logits.masked_fill(~fits.to(logits.device), float("-inf"))
        if sampling.greedy:
            acc = accept_greedy(tree, logits)
        else:
            acc = accept_sampling(tree, logits, temperature=sampling.temperature, top_p=sampling.top_p,
                                  token_map=self.draft.token_map if self.draft is not None else None,
                                  generators=batch.gens, top_k=sampling.top_k, min_p=sampling.min_p)
        if sampling.logprobs is not None:  # the columns of a path produced its draft tokens and the bonus token
            for j, ri in enumerate(batch.rows):
                path = acc.paths[j]
                new = [int(tree.tokens[j, c]) for c in path[1:]] + [acc.bonus[j]]
                rows[ri].step_logprobs = token_logprobs(raw[j, path], new, sampling.logprobs)
        return acc, feats, lt

    def _commit(self, batch: DecodeBatch, tree: DraftTree, acc: Acceptance, feats: torch.Tensor | None, lt: int,
                rows: Mapping[int, DecodeRow], *, drafting: bool = True) -> None:
        """Keep the accepted path in the target cache; let the drafter re-read it (deferred to the next drafting
        step when this one did not draft)."""
        b = len(batch.rows)
        lens = [len(p) for p in acc.paths]
        m = max(lens)
        index = torch.zeros(b, m, dtype=torch.long)
        valid = torch.zeros(b, m, dtype=torch.bool)
        nxt = torch.full((b, m), self.pad_id, dtype=torch.long)
        for j, path in enumerate(acc.paths):
            index[j, : len(path)] = torch.tensor(path)
            valid[j, : len(path)] = True
            toks = [int(tree.tokens[j, c]) for c in path[1:]] + [acc.bonus[j]]
            nxt[j, : len(toks)] = torch.tensor(toks)
        index, valid, nxt = index.to(self.device), valid.to(self.device), nxt.to(self.device)
        lens_t = torch.tensor(lens, device=self.device)
        commit_block(batch.t_cache, lt, index)
        batch.t_valid = torch.cat([batch.t_valid, valid], dim=1)
        pos = batch.next_pos[:, None] + torch.arange(m, device=self.device)
        batch.next_pos = batch.next_pos + lens_t
        batch.pending = torch.tensor(acc.bonus, dtype=torch.long, device=self.device)
        if self.draft is None:
            return
        alive = [j for j, ri in enumerate(batch.rows) if rows[ri].finish is None]
        if not alive:
            return  # every row is done: skip the drafter's catch-up forward
        if feats is None:
            path_feats = torch.zeros(b, m, 1, device=self.device)
        else:
            path_feats = feats.gather(1, index[:, :, None].expand(b, m, feats.shape[-1]))
        if not drafting:
            batch.backlog.append(Block(nxt, path_feats, pos, valid))
            return
        allowed = block_mask(batch.d_valid, causal_block(valid))
        d_logits, d_hidden = self.draft.step(batch.d_cache, nxt, path_feats, pos, allowed, own_hidden=False)
        batch.d_valid = torch.cat([batch.d_valid, valid], dim=1)
        last = (lens_t - 1)[:, None, None]
        batch.root_logits = d_logits.gather(1, last.expand(b, 1, d_logits.shape[-1]))[:, 0]
        batch.root_hidden = d_hidden.gather(1, last.expand(b, 1, d_hidden.shape[-1]))[:, 0]


class BaselineDecoder(SpecDecoder):
    """Plain decoding with the same loop, caches and stops as :class:`SpecDecoder` (fair speed comparisons)."""

    def __init__(self, target_model: Any, tokenizer: Any, *, eos_token_ids: Sequence[int] | None = None) -> None:
        super().__init__(target_model, tokenizer, None, SpecConfig(), eos_token_ids=eos_token_ids)

    @classmethod
    def from_engine(cls, engine: Any, drafter: Any = None, spec: SpecConfig | None = None,
                    **kwargs: Any) -> BaselineDecoder:
        return cls(engine.model, engine.tokenizer, eos_token_ids=engine.info.eos_token_ids)


def chain_of(spec: SpecConfig) -> SpecConfig:
    """The chain as deep as ``spec``'s tree: what a step drafts while a row of it is constrained."""
    return spec.model_copy(update={"topk": 1, "num_draft_tokens": spec.num_steps + 1})


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    eos: set[int] = set()
    for src in (getattr(getattr(model, "generation_config", None), "eos_token_id", None), tokenizer.eos_token_id):
        if src is None:
            continue
        eos.update([src] if isinstance(src, int) else list(src))
    return eos


def _row_generator(seed: int | None, row: int) -> torch.Generator | None:
    """Per-request RNG (CPU), so a sampled answer does not depend on the rest of the batch."""
    if seed is None:
        return None
    return torch.Generator(device="cpu").manual_seed(int(seed) * 1_000_003 + row)


def _hits_stop(tokenizer: Any, tokens: list[int], stops: Sequence[str]) -> bool:
    tail = tokenizer.decode(tokens[-16:], skip_special_tokens=True)
    return any(s in tail for s in stops)
