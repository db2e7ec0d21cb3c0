"""The replica's start-up self-test: a few fixed prompts decoded greedily, their pooled accept length measured.

Below ``serve.self_test_min_accept_length`` the replica stays up but reports unhealthy (``/health`` 503,
``eaglenest_serve_replica_healthy`` 0) and refuses requests with the reason: a drafter that does not help (wrong
target, wrong algorithm) is caught before traffic, not by an alert later.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from eaglenest.engines.base import SamplingParams
from eaglenest.serve.jobs import BackendBase, SpecStats

log = logging.getLogger("eaglenest.serve")

SELF_TEST_PROMPTS: tuple[tuple[dict[str, str], ...], ...] = (
    ({"role": "user", "content": "Hello! Who are you?"},),
    ({"role": "user", "content": "Write a short poem about the sea."},),
    ({"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "What is 12 times 7? Explain briefly."}),
)
"""Fixed prompts decoded greedily at start; their pooled accept length must reach the configured minimum."""
SELF_TEST_MAX_TOKENS = 32


@dataclass
class SelfTest:
    ok: bool
    accept_length: float
    min_accept_length: float
    tokens: int
    seconds: float
    message: str

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def run_self_test(backend: BackendBase, minimum: float, *, one_at_a_time: bool = False) -> SelfTest:
    """Decode the fixed prompts on ``backend``; a pooled accept length below ``minimum`` (or an error) fails.
    ``one_at_a_time``: each prompt alone (a tuned schedule drafts at batch 1, maybe not at 3)."""
    t0 = time.perf_counter()
    tokens, pooled = 0, SpecStats()
    try:
        prompts = [backend.render_chat(list(conv)) for conv in SELF_TEST_PROMPTS]
        sampling = SamplingParams(temperature=0.0, max_new_tokens=SELF_TEST_MAX_TOKENS)
        batches = [[p] for p in prompts] if one_at_a_time else [prompts]
        for batch in batches:
            for out, _, stats in backend.generate_many(batch, sampling, timeout=600):
                tokens += len(out)
                pooled = pooled + stats
    except Exception as e:  # the replica stays up and says why
        log.exception("self-test failed")
        return SelfTest(False, 0.0, minimum, tokens, time.perf_counter() - t0,
                        f"self-test failed: {type(e).__name__}: {e}")
    acc = pooled.accept_length
    ok = acc >= minimum
    what = f"{'speculative ' + (backend.algorithm or '') if backend.speculative else 'baseline'}"
    msg = f"self-test ({what}) accept length {acc:.2f} over {len(SELF_TEST_PROMPTS)} prompts / {tokens} tokens"
    if not ok:
        msg += (f" is below serve.self_test_min_accept_length {minimum}: the drafter is not helping (check "
                f"`eaglenest preflight --target ... --drafter ...`, that the drafter was trained on this "
                f"target, and the speculative algorithm EAGLE3)")
    return SelfTest(ok, acc, minimum, tokens, time.perf_counter() - t0, msg)
