"""The reference EAGLE-3 speculative decoder: drafting, trees, sampling, evaluation. Serve and eval use it.

Public API (serve and eval use these names only; the submodules' ``_``-names are internals):

- :class:`SpecDecoder` / :class:`BaselineDecoder`: ``generate(prompts, sampling)`` and ``stream(prompt, sampling)``;
  the incremental API ``prefill`` / ``step`` / ``drop_finished`` over a caller-owned ``{row id: DecodeRow}`` table
  and a :class:`DecodeBatch`, with :func:`merge_batches` to admit rows at a step boundary (continuous batching)
- :class:`SpecResult` (one finished request) and :class:`StreamChunk` (the tokens of one target forward)
- the prompt suites (:mod:`~eaglenest.speculative.suites`): :func:`load_suite` reads MT-Bench, HumanEval, BFCL or
  ShareGPT from their installed packages (:data:`SUITES`), :func:`evaluate_suites` gives the per-suite table,
  :func:`evaluate_suites_served` the same table through a served endpoint (:func:`openai_ask`)
"""

from eaglenest.speculative.batching import merge_batches
from eaglenest.speculative.decoder import (
    BaselineDecoder,
    DecodeBatch,
    DecodeRow,
    SpecDecoder,
    SpecResult,
    StreamChunk,
)
from eaglenest.speculative.suite_eval import evaluate_suite, evaluate_suites
from eaglenest.speculative.suite_served import evaluate_suites_served, openai_ask
from eaglenest.speculative.suites import SUITES, SuiteError, load_suite

__all__ = ["SUITES", "BaselineDecoder", "DecodeBatch", "DecodeRow", "SpecDecoder", "SpecResult", "StreamChunk",
           "SuiteError", "evaluate_suite", "evaluate_suites", "evaluate_suites_served", "load_suite", "merge_batches",
           "openai_ask"]
