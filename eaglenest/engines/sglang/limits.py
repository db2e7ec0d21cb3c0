"""What SGLang 0.5.14 accepts, checked before an engine starts: its server arguments, and the decode batch its triton
MLA kernels can address.

An engine that fails these would fail inside ``sglang.Engine``'s constructor with a bare ``TypeError``, or, worse,
start and then die mid-run with "an illegal memory access" (a regen job's engine actor restarted by Ray until the job
is stopped): both were seen on the H200, so both are refused here with the numbers and the fix. Pure functions: no
sglang import (the field names are passed in), tested on a CPU.
"""

from __future__ import annotations

import difflib
import logging
import math
from collections.abc import Collection, Mapping
from typing import Any

from eaglenest.contracts.target import TargetSpec

_log = logging.getLogger(__name__)

INT32_MAX = 2**31 - 1
MLA_DECODE_MIN_BLOCK_KV = 32
"""SGLang 0.5.14 ``triton_backend._MLA_DECODE_MIN_BLOCK_KV``: the fewest KV tokens an MLA decode split covers"""
TRITON_KV_SPLITS = 8
"""SGLang 0.5.14's default ``triton_attention_num_kv_splits``"""
SGLANG_SPECULATIVE_RUNNING_REQUESTS = 48
"""what SGLang 0.5.14 silently sets ``max_running_requests`` to for any EAGLE launch that leaves it unset
(``arg_groups/speculative_hook.py``), where a plain engine gets 2,048-4,096 from its KV pool"""


def mla_triton_kv_splits(context_len: int, sm_count: int = 256, base: int = TRITON_KV_SPLITS,
                         split_tile_size: int | None = None) -> int:
    """The KV splits SGLang 0.5.14's triton backend sizes its MLA decode buffers for (``max_kv_splits``): the
    configured base, raised for MLA to ``min(next_pow2(SMs), next_pow2(ceil(context / 32)))``; a split tile size
    replaces both by ``ceil(context / tile)``. ``sm_count`` 256 bounds every current GPU (H100/H200: 132 SMs)."""
    if split_tile_size:
        return math.ceil(context_len / split_tile_size)
    if sm_count <= 0:
        return base
    return max(base, min(_next_pow2(sm_count), _next_pow2(math.ceil(context_len / MLA_DECODE_MIN_BLOCK_KV))))


def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def mla_triton_max_running_requests(heads_per_rank: int, kv_lora_rank: int, kv_splits: int) -> int:
    """The largest decode batch whose partial results SGLang 0.5.14's triton MLA decode can address: its kernels
    index the fp32 buffer ``[batch, heads, kv_splits, kv_lora_rank]`` with 32-bit ``batch * stride`` offsets
    (``decode_attention._fwd_kernel_stage2``), so a larger batch reads past the buffer and the engine dies with
    "an illegal memory access" (seen on the H200: Kimi's widths, context 2048 -> 64 splits, 1,860 requests)."""
    return INT32_MAX // (heads_per_rank * kv_splits * kv_lora_rank)


MLA_DECODE_BUFFER_SHARE = 0.25
"""The most of an engine's non-static memory (SGLang's slack: the memory free at its start x (1 -
``mem_fraction_static``)) the triton MLA decode's per-forward buffer may take. That buffer is allocated at every
decode forward outside SGLang's memory plan; seen: 7.99 GiB in a 35 GiB slack ran (H200, fraction 0.75), 7.99 GiB in a
19.5 GiB slack died out of memory at the first full decode (H100, fraction 0.75; 2026-12-06). A quarter is
consistent with both; not yet run on an 80 GB card with the bound in place."""


def mla_triton_buffer_bytes(heads_per_rank: int, kv_lora_rank: int, kv_splits: int) -> int:
    """Bytes a running request adds to SGLang 0.5.14's triton MLA decode buffers (``attn_logits`` fp32 [batch,
    heads, kv_splits, kv_lora_rank] and ``attn_lse`` fp32 [batch, heads, kv_splits], allocated every decode forward
    without CUDA graphs)."""
    return heads_per_rank * kv_splits * (kv_lora_rank + 1) * 4


def mla_triton_memory_max_running_requests(heads_per_rank: int, kv_lora_rank: int, kv_splits: int,
                                           gpu_bytes: int, mem_fraction_static: float) -> int:
    """The largest decode batch whose triton MLA buffers fit :data:`MLA_DECODE_BUFFER_SHARE` of the engine's
    non-static memory (``gpu_bytes`` free at its start x (1 - ``mem_fraction_static``))."""
    slack = gpu_bytes * (1.0 - mem_fraction_static)
    return max(1, int(MLA_DECODE_BUFFER_SHARE * slack) // mla_triton_buffer_bytes(heads_per_rank, kv_lora_rank,
                                                                                  kv_splits))


def bound_running_requests(kw: dict[str, Any], target: TargetSpec, sm_count: int | None = None,
                           gpu_bytes: int | None = None) -> None:
    """An MLA target on the triton attention backend: ``max_running_requests`` at most what its decode kernels can
    address (:func:`mla_triton_max_running_requests`): set when unset, refused with the numbers when larger. Where
    the GPU's memory is known (``gpu_bytes``: what the engine starts with; else the device's total, the engine
    having the GPU to itself), an unset value is also kept within
    what the decode buffers may take of the engine's memory (:func:`mla_triton_memory_max_running_requests`); a
    larger explicit value is kept with a warning (that bound is a rule of thumb, the first one is the kernel's)."""
    if not target.kv_lora_rank or kw.get("attention_backend", "triton") != "triton":
        return
    context = int(kw.get("context_length") or target.context_length or target.max_position_embeddings or 0)
    tp = int(kw.get("tp_size") or 1)
    heads = max(1, (target.num_attention_heads or 1) // tp)
    if sm_count is None:
        sm_count = _device_sm_count()
    splits = mla_triton_kv_splits(context, sm_count, int(kw.get("triton_attention_num_kv_splits") or TRITON_KV_SPLITS),
                                  kw.get("triton_attention_split_tile_size"))
    cap = mla_triton_max_running_requests(heads, target.kv_lora_rank, splits)
    fraction = kw.get("mem_fraction_static")
    if gpu_bytes is None and fraction is not None:
        gpu_bytes = device_total_bytes()
    memory_cap = (mla_triton_memory_max_running_requests(heads, target.kv_lora_rank, splits, gpu_bytes,
                                                         float(fraction))
                  if gpu_bytes and fraction is not None else None)
    asked = kw.get("max_running_requests")
    if asked is None:
        kw["max_running_requests"] = min(cap, memory_cap) if memory_cap else cap
    elif memory_cap and int(asked) > memory_cap and int(asked) <= cap:
        buffer_gib = int(asked) * mla_triton_buffer_bytes(heads, target.kv_lora_rank, splits) / 2**30
        slack_gib = gpu_bytes * (1.0 - float(fraction)) / 2**30
        _log.warning(
            "target.sglang.max_running_requests %s: SGLang's triton MLA decode would allocate %.2f GiB a forward "
            "outside its memory plan, %.0f%% of the engine's %.1f GiB of non-static memory (%.1f GiB x (1 - "
            "mem_fraction_static %s)); unset, eaglenest would allow %d (%.0f%% of it; an H100 engine whose buffer "
            "took 41%% died out of memory). Lower max_running_requests or mem_fraction_static if this one does",
            asked, buffer_gib, 100 * buffer_gib / slack_gib, slack_gib, gpu_bytes / 2**30, fraction, memory_cap,
            100 * MLA_DECODE_BUFFER_SHARE)
    elif int(asked) > cap:
        raise ValueError(
            f"target.sglang.max_running_requests {asked} is more than SGLang's triton MLA decode can address for "
            f"this target: {heads} heads x {splits} KV splits (context {context}) x kv_lora_rank "
            f"{target.kv_lora_rank} fp32 partials a request, indexed with 32-bit offsets, allow {cap} requests; "
            f"more ends in 'an illegal memory access'. Set max_running_requests <= {cap}, a shorter "
            f"context_length, or extra_args triton_attention_split_tile_size (fewer splits)")


def speculative_running_requests(kw: Mapping[str, Any], concurrency: int | None) -> dict[str, int]:
    """``max_running_requests`` for a speculative launch (empty: the launch already sets it).

    SGLang caps every EAGLE engine without the argument at 48 running requests; the rest wait in its queue. On an
    H100 (BENCHMARKS.md, #29's rehearsal) a 3-1-4 engine given 256 concurrent requests ran at 0.33x of the plain
    engine's tok/s, and a served schedule that drafts nothing at that load gave 3,428 tok/s to 256 streams (TTFT
    p50 7.2 s) where the plain engine had measured ~20,000 in the tune. The caller's ``concurrency`` (serve's
    ``max_concurrent_requests``, a bench's largest batch) takes its place, so speculation is never a concurrency cap
    the plain engine does not have; without one SGLang's 48 is set explicitly and said."""
    if kw.get("max_running_requests") is not None:
        return {}
    if concurrency is None:
        _log.warning("speculative engine: max_running_requests %d (SGLang's own cap for speculative launches; set "
                     "target.sglang.max_running_requests to run more requests at once)",
                     SGLANG_SPECULATIVE_RUNNING_REQUESTS)
        return {"max_running_requests": SGLANG_SPECULATIVE_RUNNING_REQUESTS}
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    return {"max_running_requests": int(concurrency)}


def _device_properties() -> Any | None:
    """The current GPU's properties (None without one). Read from the driver's properties: asking for the free memory
    would create a CUDA context in this process, held for the engine's life beside SGLang's own."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(torch.cuda.current_device())
    except Exception:  # noqa: BLE001 - without them only the bounds that need no device apply
        pass
    return None


def _device_sm_count() -> int:
    """The current GPU's streaming multiprocessors (256, every current GPU's bound, without one)."""
    props = _device_properties()
    return int(props.multi_processor_count) if props is not None else 256


def device_total_bytes() -> int | None:
    """The current GPU's memory (None without one)."""
    props = _device_properties()
    return int(props.total_memory) if props is not None else None


def unknown_server_args(kw: Mapping[str, Any], fields: Collection[str]) -> list[str]:
    """Keys of ``kw`` that are not SGLang ``ServerArgs`` fields (``fields``: its dataclass field names)."""
    return sorted(k for k in kw if k not in fields)


def check_server_args(kw: Mapping[str, Any], fields: Collection[str], version: str) -> None:
    """Refuse launch kwargs SGLang does not know before an engine starts (``Engine(**kw)`` would fail with a bare
    TypeError inside its constructor), naming the closest field: extra_args are passed through as given."""
    bad = unknown_server_args(kw, fields)
    if bad:
        hints = {k: difflib.get_close_matches(k, list(fields), n=2, cutoff=0.6) for k in bad}
        said = "; ".join(f"{k}" + (f" (did you mean {' or '.join(v)}?)" if v else "") for k, v in hints.items())
        raise ValueError(f"sglang {version} has no server argument {said}: fix target.sglang.extra_args")
