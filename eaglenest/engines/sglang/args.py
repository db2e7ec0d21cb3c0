"""Pure helpers of the SGLang backend: launch kwargs, sampling params, output parsing, batching, version check.

Nothing here imports sglang, so all of it is tested on a CPU box without the package; ``sglang.py`` wires these into
a live ``sglang.Engine`` and the in-process capture runner.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from eaglenest.config import SGLangEngineConfig
from eaglenest.contracts.metrics import accept_length
from eaglenest.contracts.target import TargetSpec
from eaglenest.engines.base import FinishReason, Generation, SamplingParams
from eaglenest.engines.sglang.limits import bound_running_requests
from eaglenest.targets import ARCHS, arch_for

CAPTURE_MAX_SEQS = 256
"""Sequences per capture forward (the capture runner's max_running_requests: its request-slot pool)."""

SGLANG_VERSION = "0.5.14"
"""The one SGLang release this backend is written and tested against (its capture path touches internals)."""


class SGLangVersionError(RuntimeError):
    """The installed sglang is not the pinned release."""


class SGLangOutputError(RuntimeError):
    """An engine answer this backend cannot turn into a Generation (aborted request, missing fields)."""


def check_sglang_version(installed: str | None) -> None:
    """Refuse any sglang but the pinned one: capture relies on internals that move between releases."""
    if installed is None:
        raise SGLangVersionError(
            f"sglang is not installed; the sglang engine needs sglang=={SGLANG_VERSION} "
            f"(pip install 'eaglenest[gpu]', or the GPU bundle: source .gpu/bin/install.sh)"
        )
    if installed.split("+")[0] != SGLANG_VERSION:
        raise SGLangVersionError(
            f"sglang {installed} is installed but eaglenest's sglang engine is pinned to {SGLANG_VERSION} "
            f"(its hidden-state capture uses sglang internals listed in engines.sglang.symbols.SGLANG_INTERNALS); "
            f"install sglang=={SGLANG_VERSION}"
        )


_ENGINE_FIELDS = (
    "tp_size", "mem_fraction_static", "attention_backend", "sampling_backend", "grammar_backend",
    "max_running_requests", "context_length",
)


def engine_kwargs(
    model_path: str,
    cfg: SGLangEngineConfig,
    *,
    dtype: str = "auto",
    seed: int | None = 0,
    trust_remote_code: bool = False,
    target: TargetSpec | None = None,
) -> dict[str, Any]:
    """``sglang.Engine`` kwargs for generation: prefix (radix) caching on, the configured backends, no spec.

    ``extra_args`` come last but may not override what this backend relies on (see ``_PROTECTED``). ``target``
    (the model's facts): running requests are bounded where SGLang's kernels need it
    (:func:`bound_running_requests`).
    """
    kw: dict[str, Any] = {
        "model_path": model_path,
        "dtype": dtype,
        "trust_remote_code": trust_remote_code,
        "disable_radix_cache": False,
        "log_level": "error",
        "incremental_streaming_output": False,  # streamed chunks carry all ids so far (StreamedRequest relies on it)
    }
    if seed is not None:
        kw["random_seed"] = int(seed)
    for name in _ENGINE_FIELDS:
        value = getattr(cfg, name)
        if value is not None:
            kw[name] = value
    if cfg.disable_cuda_graph:
        kw["disable_cuda_graph"] = True
    _merge_extra(kw, cfg.extra_args)
    if target is not None:
        bound_running_requests(kw, target)
    return kw


_PROTECTED = ("model_path", "incremental_streaming_output", "speculative_algorithm", "speculative_draft_model_path",
              "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens",
              "speculative_adaptive", "speculative_adaptive_config",
              "disable_radix_cache", "chunked_prefill_size", "forward_hooks")


def generation_capture_architectures() -> list[str]:
    """Targets whose SGLang model code the capture hooks are verified against (call convention, module names,
    residual stream: tests/unit/test_sglang_contract.py; states vs the prefill capture on the H200: BENCHMARKS.md);
    each architecture record says so (``eaglenest.targets``)."""
    return [a for rec in ARCHS if rec.generation_capture for a in rec.architectures]


def check_generation_capture(architecture: str, tp_size: int) -> None:
    """Refuse ``target.sglang.capture: generation`` where it is not verified, with the way out."""
    if not arch_for(architecture).generation_capture:
        raise ValueError(
            f"target.sglang.capture: generation is verified for {generation_capture_architectures()} targets "
            f"only (the hooks rely on that model code's layer call convention); this target is {architecture}: use "
            f"target.sglang.capture: prefill")
    if tp_size != 1:
        raise ValueError(
            f"target.sglang.capture: generation is verified with tp_size 1 only (target.sglang.tp_size is "
            f"{tp_size}): use target.sglang.capture: prefill, or one actor per GPU")


def generation_capture_kwargs(kw: dict[str, Any], hooks: list[dict[str, Any]]) -> dict[str, Any]:
    """Generation kwargs that record hidden states while generating (``eaglenest.engines.sglang.hooks``).

    Hooks do not run inside CUDA-graph replays, and a radix-cache hit would skip a prompt's rows, so both are off;
    speculative decoding would feed draft rows through the same layers, so it is refused.
    """
    if kw.get("speculative_algorithm"):
        raise ValueError("capture during generation records the target's own forwards; it cannot run under "
                         "speculative decoding (use it for regen only)")
    return {**kw, "forward_hooks": hooks, "disable_radix_cache": True, "disable_cuda_graph": True}


def _merge_extra(kw: dict[str, Any], extra: Mapping[str, Any]) -> None:
    bad = sorted(set(extra) & set(_PROTECTED))
    if bad:
        raise ValueError(
            f"target.sglang.extra_args may not set {bad}: eaglenest derives them (model from target.model, "
            f"speculative args from the drafter and serve.spec, caching per operation); remove them from extra_args"
        )
    kw.update(extra)


def capture_server_kwargs(
    model_path: str,
    cfg: SGLangEngineConfig,
    *,
    dtype: str = "auto",
    trust_remote_code: bool = False,
    max_total_tokens: int | None = None,
) -> dict[str, Any]:
    """``ServerArgs`` kwargs for the in-process prefill-only capture runner.

    Radix cache off (a prefix hit would skip rows), chunked prefill off (rows arrive only at the last chunk), CUDA
    graphs off (capture is eager prefill), no tokenizer (we pass token ids), tp 1 (the runner lives in this process).
    """
    if cfg.tp_size != 1:
        raise ValueError(
            f"in-process capture runs on one GPU; target.sglang.tp_size is {cfg.tp_size}. Capture with tp_size 1 "
            f"(one actor per GPU, data parallel over actors) or use the hf engine for capture"
        )
    kw: dict[str, Any] = {
        "model_path": model_path,
        "dtype": dtype,
        "trust_remote_code": trust_remote_code,
        "tp_size": 1,
        "mem_fraction_static": cfg.capture_mem_fraction_static,
        "attention_backend": cfg.attention_backend,
        "sampling_backend": cfg.sampling_backend,
        "grammar_backend": cfg.grammar_backend,
        "disable_radix_cache": True,
        "chunked_prefill_size": -1,
        "disable_cuda_graph": True,
        "skip_tokenizer_init": True,
        "max_running_requests": CAPTURE_MAX_SEQS,
        "log_level": "error",
    }
    if cfg.context_length is not None:
        kw["context_length"] = cfg.context_length
    if max_total_tokens is not None:
        kw["max_total_tokens"] = int(max_total_tokens)
    return kw


def sampling_params_dict(sampling: SamplingParams, *, stop_token_ids: Sequence[int] = ()) -> dict[str, Any]:
    """Our SamplingParams as sglang's sampling_params dict (greedy = temperature 0)."""
    sp: dict[str, Any] = {
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": float(sampling.temperature),
        "top_p": float(sampling.top_p),
        "skip_special_tokens": True,
    }
    if sampling.greedy:
        sp["top_k"] = 1
    elif sampling.top_k > 0:
        sp["top_k"] = int(sampling.top_k)
    if sampling.min_p > 0:
        sp["min_p"] = float(sampling.min_p)
    if sampling.repetition_penalty != 1.0:
        sp["repetition_penalty"] = float(sampling.repetition_penalty)
    if sampling.stop:
        sp["stop"] = list(sampling.stop)
    if stop_token_ids and not sampling.ignore_eos:
        sp["stop_token_ids"] = sorted({int(t) for t in stop_token_ids})
    if sampling.seed is not None and not sampling.greedy:
        sp["sampling_seed"] = int(sampling.seed)
    if sampling.ignore_eos:
        sp["ignore_eos"] = True
    if sampling.constraint is not None:  # SGLang's grammar backend (and its reasoning parser) apply it
        if sampling.constraint.schema is not None:
            sp["json_schema"] = sampling.constraint.schema
        else:  # llguidance's "ebnf" takes Lark (serve refuses tool_choice on other grammar backends)
            sp["ebnf"] = sampling.constraint.lark
    return sp


def request_kwargs(sampling: SamplingParams) -> dict[str, Any]:
    """``Engine.async_generate``'s per-request arguments beyond the sampling dict: the logprobs ones, and
    ``require_reasoning`` for a constrained answer whose prompt opened a reasoning block (SGLang's grammar then waits
    for the reasoning's end; it needs the engine launched with a ``reasoning_parser``, via ``extra_args``)."""
    kw = logprob_kwargs(sampling)
    if sampling.constraint is not None and sampling.constraint.in_reasoning:
        kw["require_reasoning"] = True
    return kw


def logprob_kwargs(sampling: SamplingParams) -> dict[str, Any]:
    """The ``Engine.generate`` / ``async_generate`` arguments that make SGLang return output logprobs (none when the
    request did not ask): ``return_logprob`` and ``top_logprobs_num``; ``logprob_start_len=-1`` skips the prompt."""
    if sampling.logprobs is None:
        return {}
    return {"return_logprob": True, "top_logprobs_num": int(sampling.logprobs), "logprob_start_len": -1}


def output_logprobs(meta: Mapping[str, Any], start: int,
                    end: int) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """Output positions ``start:end`` of ``meta_info['output_token_logprobs']`` (``(logprob, token_id, text)``
    triples) with their ``output_top_logprobs`` alternatives, as ``(id, logprob, [(id, logprob), ...])``.

    Positions SGLang did not report (an end-of-turn token it trimmed and we put back) get no entry.
    """
    chosen = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs") or []
    out = []
    for i in range(start, min(end, len(chosen))):
        lp, tid = chosen[i][0], chosen[i][1]
        alts = tops[i] if i < len(tops) and tops[i] else []
        out.append((int(tid), float(lp), [(int(a[1]), float(a[0])) for a in alts]))
    return out


def per_request_sampling(sampling: SamplingParams, n: int, *, stop_token_ids: Sequence[int] = ()) -> list[dict]:
    """One sampling dict per request; a seeded run gets seed*1_000_003+row per request, like the hf backend."""
    base = sampling_params_dict(sampling, stop_token_ids=stop_token_ids)
    out = []
    for row in range(n):
        sp = dict(base)
        if "sampling_seed" in sp:
            sp["sampling_seed"] = (int(sampling.seed) * 1_000_003 + row) % (2**31 - 1)  # type: ignore[arg-type]
        out.append(sp)
    return out


def map_finish_reason(finish: Any) -> FinishReason:
    """sglang's ``meta_info['finish_reason']`` (``{"type": "stop"|"length"|"abort", ...}``) -> "stop" / "length".

    An aborted request is an error, never a silently short sample.
    """
    kind = finish.get("type") if isinstance(finish, Mapping) else finish
    if kind == "stop":
        return "stop"
    if kind == "length":
        return "length"
    if kind == "abort":
        msg = finish.get("message") if isinstance(finish, Mapping) else None
        raise SGLangOutputError(
            f"sglang aborted the request: {msg or finish!r} (check prompt length vs context_length)"
        )
    raise SGLangOutputError(f"sglang returned an unknown finish_reason {finish!r}; expected stop or length")


def spec_meta(meta_info: Mapping[str, Any]) -> dict[str, Any]:
    """Per-request speculative metrics from ``meta_info``; empty when the request ran without speculation.

    ``accept_length`` = completion_tokens / spec_verify_ct (each verify step emits its accepted drafts plus the bonus
    token, so completion - verify tokens were accepted drafts): :func:`eaglenest.contracts.metrics.accept_length`,
    recomputed here rather than trusted from ``spec_accept_length``.
    """
    verify = int(meta_info.get("spec_verify_ct") or 0)
    if verify <= 0:
        return {}
    completion = int(meta_info.get("completion_tokens") or 0)
    accepted = meta_info.get("spec_num_correct_drafts", meta_info.get("spec_accept_token_num"))
    proposed = meta_info.get("spec_num_proposed_drafts", meta_info.get("spec_draft_token_num"))
    out: dict[str, Any] = {
        "spec_verify_ct": verify,
        "completion_tokens": completion,
        "accept_length": accept_length(verify, completion - verify),
    }
    if "spec_accept_length" in meta_info:
        out["sglang_spec_accept_length"] = float(meta_info["spec_accept_length"])
    if accepted is not None:
        out["draft_tokens_accepted"] = int(accepted)
    if proposed is not None:
        out["draft_tokens_proposed"] = int(proposed)
    return out


def output_ids(out: Mapping[str, Any]) -> list[int]:
    """The exact ids of one ``Engine.generate`` result, the end-of-turn token kept explicit."""
    meta = out.get("meta_info")
    if not isinstance(meta, Mapping):
        raise SGLangOutputError(f"sglang output has no meta_info: keys {sorted(out)}")
    if "output_ids" not in out or out["output_ids"] is None:
        raise SGLangOutputError("sglang output has no output_ids; this backend needs token ids (do not stream)")
    ids = [int(t) for t in out["output_ids"]]
    finish = meta.get("finish_reason")
    matched = finish.get("matched") if isinstance(finish, Mapping) else None
    if map_finish_reason(finish) == "stop" and isinstance(matched, int) and (not ids or ids[-1] != matched):
        ids.append(matched)  # whatever the engine trimmed
    return ids


def generation_from_output(
    out: Mapping[str, Any],
    *,
    prompt_len: int,
    decode: Callable[[list[int]], str],
    stop: Sequence[str] = (),
) -> Generation:
    """One ``Engine.generate`` result dict -> Generation with exact token ids.

    The finishing token stays in ``token_ids`` (a stop on EOS keeps the EOS, as in the hf backend); text is decoded by
    our tokenizer and cut at the first stop string, the same way for every backend.
    """
    ids = output_ids(out)
    return _generation(out, ids, decode(ids), prompt_len=prompt_len, stop=stop)


def _generation(out: Mapping[str, Any], ids: list[int], text: str, *, prompt_len: int,
                stop: Sequence[str]) -> Generation:
    """:func:`generation_from_output` given the result's :func:`output_ids` and their decoded text."""
    meta = out["meta_info"]
    reason = map_finish_reason(meta.get("finish_reason"))
    for s in stop:
        cut = text.find(s)
        if cut >= 0:
            text, reason = text[:cut], "stop"
    prompt_tokens = int(meta.get("prompt_tokens", prompt_len) or prompt_len)
    gen_meta: dict[str, Any] = {"engine": "sglang", **spec_meta(meta)}
    if "completion_tokens" in meta:
        gen_meta["completion_tokens"] = int(meta["completion_tokens"])  # forwards the engine ran for this request
    if "e2e_latency" in meta:
        gen_meta["e2e_latency"] = float(meta["e2e_latency"])
    return Generation(token_ids=ids, text=text, finish_reason=reason, prompt_tokens=prompt_tokens, meta=gen_meta)


class StreamedRequest:
    """One request streamed by ``Engine.async_generate(stream=True)``: cumulative chunks in, new token ids out.

    Intermediate chunks carry every output id so far (``incremental_streaming_output`` is off in our engine
    kwargs) and no finish reason; the finished chunk goes through :func:`generation_from_output`, so a stream ends
    with exactly the ids and text a non-streamed call returns.
    """

    def __init__(self, *, prompt_len: int, decode: Callable[[list[int]], str], stop: Sequence[str] = ()) -> None:
        self.prompt_len = prompt_len
        self.decode = decode
        self.stop = tuple(stop)
        self.sent = 0
        self.result: Generation | None = None

    def feed(self, out: Mapping[str, Any]) -> list[int]:
        """The ids of ``out`` not returned before; sets ``result`` on the finished chunk."""
        meta = out.get("meta_info")
        if not isinstance(meta, Mapping):
            raise SGLangOutputError(f"sglang stream chunk has no meta_info: keys {sorted(out)}")
        if meta.get("finish_reason") is None:
            ids = out.get("output_ids")
            if ids is None:
                raise SGLangOutputError("sglang stream chunk has no output_ids; this backend needs token ids")
            if len(ids) < self.sent:
                raise SGLangOutputError(f"sglang stream went back from {self.sent} to {len(ids)} output ids "
                                        "(incremental_streaming_output must stay off)")
            new = [int(t) for t in ids[self.sent:]]
        else:
            self.result = generation_from_output(out, prompt_len=self.prompt_len, decode=self.decode, stop=self.stop)
            if len(self.result.token_ids) < self.sent:
                raise SGLangOutputError(f"sglang finished with {len(self.result.token_ids)} ids after streaming "
                                        f"{self.sent}")
            new = self.result.token_ids[self.sent:]
        self.sent += len(new)
        return new


def run_generate(
    generate: Callable[..., Any],
    prompts: Sequence[Sequence[int]],
    sampling: SamplingParams,
    *,
    decode: Callable[[list[int]], str],
    decode_many: Callable[[list[list[int]]], list[str]] | None = None,
    vocab_size: int | None = None,
    eos_token_ids: Sequence[int] = (),
    rids: Sequence[str] | None = None,
) -> list[Generation]:
    """Submit every prompt in ONE ``generate(input_ids=[...], sampling_params=[...])`` call and parse the answers.

    One call lets sglang's scheduler batch continuously (and share prefixes); looping here would serialise it.
    ``rids`` names the requests (capture during generation finds their rows by these ids).
    """
    if not prompts:
        return []
    ids = check_prompts(prompts, vocab_size=vocab_size)
    sp = per_request_sampling(sampling, len(ids), stop_token_ids=eos_token_ids)
    outs = generate(input_ids=ids, sampling_params=sp, **({"rid": list(rids)} if rids is not None else {}))
    if isinstance(outs, Mapping):
        outs = [outs]
    if len(outs) != len(ids):
        raise SGLangOutputError(f"sglang returned {len(outs)} outputs for {len(ids)} prompts")
    answers = [output_ids(o) for o in outs]
    # the whole batch's answers in one call where the engine can (see ``engines.base.decode_texts``)
    texts = decode_many(answers) if decode_many is not None else [decode(a) for a in answers]
    return [_generation(o, a, t, prompt_len=len(p), stop=sampling.stop)
            for o, a, t, p in zip(outs, answers, texts, ids, strict=True)]


def check_prompts(prompts: Sequence[Sequence[int]], *, vocab_size: int | None = None) -> list[list[int]]:
    """Validate token-id prompts before they reach the engine (an engine-side failure would abort the whole batch)."""
    out: list[list[int]] = []
    for i, p in enumerate(prompts):
        ids = [int(t) for t in p]
        if not ids:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        if vocab_size is not None:
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"prompt {i} has token ids outside the vocab [0, {vocab_size}): {bad[:5]}")
        out.append(ids)
    return out


def plan_capture_batches(lengths: Sequence[int], max_tokens: int, max_seqs: int = CAPTURE_MAX_SEQS) -> list[list[int]]:
    """Pack sequence indexes, in order, into prefill batches of at most ``max_tokens`` tokens / ``max_seqs`` rows.

    One sequence longer than ``max_tokens`` is refused (capture never truncates, and chunked prefill is off).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    batches: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if n < 1:
            raise ValueError(f"sequence {i} is empty: capture needs at least one token per sequence")
        if n > max_tokens:
            raise ValueError(
                f"sequence {i} has {n} tokens but one capture batch holds at most {max_tokens}; raise "
                f"target.sglang.capture_max_tokens (GPU memory permitting) or filter long samples (regen.max_tokens)"
            )
        if (used + n > max_tokens or len(cur) >= max_seqs) and cur:
            batches.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        batches.append(cur)
    return batches


def reorder_aux(order_captured: Sequence[int], wanted: Sequence[int]) -> list[int]:
    """Column-block permutation from SGLang's capture order (ascending layer index) to the caller's order."""
    pos = {layer: k for k, layer in enumerate(order_captured)}
    missing = [w for w in wanted if w not in pos]
    if missing:
        raise ValueError(f"layers {missing} were not captured (captured {list(order_captured)})")
    return [pos[w] for w in wanted]
