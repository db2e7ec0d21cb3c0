"""The reference EAGLE-3 speculative decoder: drafting, trees, sampling, evaluation. Serve and eval use it.

Public API (serve and eval use these names only; the submodules' ``_``-names are internals):

- :class:`SpecDecoder` / :class:`BaselineDecoder`: ``generate(prompts, sampling)`` and ``stream(prompt, sampling)``;
  the incremental API ``prefill`` / ``step`` / ``drop_finished`` over a caller-owned ``{row id: DecodeRow}`` table
  and a :class:`DecodeBatch`, with :func:`merge_batches` to admit rows at a step boundary (continuous batching)
- :class:`SpecResult` (one finished request) and :class:`StreamChunk` (the tokens of one target forward)
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

__all__ = ["BaselineDecoder", "DecodeBatch", "DecodeRow", "SpecDecoder", "SpecResult", "StreamChunk",
           "merge_batches"]
