"""Regen's engine warm-up: one throw-away generation between the engine's start and its first batch.

The first forwards of a fresh SGLang engine compile Triton kernels for the shapes they meet (the fused MoE and the
attention kernels of a prefill), grow the caching allocator's pools and, with capture during generation, start the
recorder (pinning its ring, starting its writer): seconds at Kimi's widths, which otherwise land inside the first
batch's generation and slow the first wave of a regen run. SGLang's own HTTP server warms up the same way before it
takes requests; an offline ``Engine`` does not. Nothing here imports sglang.
"""

from __future__ import annotations

from typing import Any

from eaglenest.engines.base import SamplingParams
from eaglenest.engines.sglang.args import sampling_params_dict

WARMUP_TEXT = "Warm-up request {i}: write a short, friendly paragraph about the number {i} and why it is interesting."


def warmup_requests(tokenizer: Any, prompts: int, new_tokens: int) -> tuple[list[list[int]], dict[str, Any]]:
    """``prompts`` distinct short prompts as token ids and their sampling (greedy, ``new_tokens`` decoded each, EOS
    ignored so every request decodes as many steps as asked)."""
    ids = [list(tokenizer(WARMUP_TEXT.format(i=i), add_special_tokens=True)["input_ids"]) for i in range(prompts)]
    sampling = sampling_params_dict(SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True))
    return ids, sampling
