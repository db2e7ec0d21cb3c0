"""The TargetEngine protocol: what every backend (transformers, SGLang) offers to regen, drafter and serve."""

from __future__ import annotations

import abc
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from eaglenest.contracts.target import TargetSpec

Message = dict[str, Any]
"""One chat message: ``role``, ``content`` and optionally ``reasoning_content``, ``tool_calls``, ``name``."""

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class OutputConstraint:
    """What an answer must be: JSON valid under ``schema`` (OpenAI's ``response_format`` / ``text.format``), or text of
    the Lark grammar ``lark`` (``tool_choice`` ``required`` / a named function: tool calls in the target's own syntax).

    ``schema`` is the JSON Schema as compact JSON text (hashable: sampling settings key the decoder's groups; a
    ``json_object`` request is ``{"type": "object"}``); exactly one of ``schema`` and ``lark`` is set. ``reasoning``
    holds the target's reasoning start and end token ids when the request separates reasoning: the answer may open
    with a reasoning block, unconstrained, and the grammar applies from its end on (vLLM and SGLang do the same with a
    reasoning parser); ``in_reasoning`` says the prompt already opened that block (a template that starts the answer
    thinking)."""

    schema: str | None = None
    lark: str | None = None
    reasoning: tuple[int, int] | None = None
    in_reasoning: bool = False

    def __post_init__(self) -> None:
        if (self.schema is None) == (self.lark is None):
            raise ValueError("an OutputConstraint holds exactly one of schema and lark")


@dataclass(frozen=True)
class SamplingParams:
    """How to continue a prompt. ``temperature == 0`` means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 128
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    """keep decoding past end-of-sequence tokens up to ``max_new_tokens`` (fixed-length benchmark requests); stop
    strings still apply"""
    top_k: int = 0
    """sample from the k most likely tokens only (0: all; the vLLM/SGLang extension)"""
    min_p: float = 0.0
    """drop tokens less likely than ``min_p`` times the most likely one (0: off)"""
    repetition_penalty: float = 1.0
    """CTRL-style penalty on every token of the prompt and the output so far (1: off; applies to greedy too)"""
    logprobs: int | None = None
    """report each generated token's log-probability and the ``logprobs`` most likely alternatives (None: off)"""
    constraint: OutputConstraint | None = None
    """structured output: every token keeps the answer a valid prefix of it (None: free text)"""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Generation:
    """One continuation. ``token_ids`` are exact and include the end-of-turn token when the model emitted it."""

    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    prompt_tokens: int = 0
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Capture:
    """Hidden states of one teacher-forced sequence, in the model's dtype, on the CPU.

    ``aux_hidden_states``: ``[T, 3H]``, the three physical aux layers concatenated in the given order.
    ``last_hidden_state``: ``[T, H]``, the final *normed* state (what the target's ``lm_head`` consumes).
    """

    aux_hidden_states: torch.Tensor
    last_hidden_state: torch.Tensor


@dataclass(frozen=True)
class CaptureHint:
    """Lets an engine that records hidden states while it generates reuse them instead of a second prefill.

    ``ref``: the ``Generation.meta["capture_ref"]`` of the sequence's last generation (its prompt and answer cover
    the sequence); ``loss_mask``: the sequence's mask, which says which positions' states training never reads
    (``contracts.states.unread_state_positions``) and so may be missing. Engines without such recording ignore hints.
    """

    ref: str
    loss_mask: Sequence[int]


@dataclass(frozen=True)
class TargetInfo:
    """What downstream contracts check against: layer count, sizes, vocab, dtype, engine identity."""

    model: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    dtype: str
    engine: str
    engine_version: str
    architecture: str
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_spec(cls, spec: TargetSpec, *, dtype: str, engine: str, engine_version: str,
                  eos_token_ids: Iterable[int]) -> TargetInfo:
        """The runtime view of a target whose facts were read once, by ``eaglenest.contracts.target``."""
        return cls(model=spec.path, num_layers=spec.num_layers, hidden_size=spec.hidden_size,
                   vocab_size=spec.vocab_size, max_position_embeddings=spec.max_position_embeddings, dtype=dtype,
                   engine=engine, engine_version=engine_version, architecture=spec.architecture,
                   eos_token_ids=tuple(sorted({int(i) for i in eos_token_ids})))


class TargetEngine(abc.ABC):
    """A target model that can generate, capture hidden states, and be asked about itself.

    Backends implement ``generate_ids`` and ``capture``; chat rendering is shared so every backend turns the same
    conversation into the same token ids.
    """

    info: TargetInfo
    tokenizer: Any
    aux_layer_ids: list[int]
    """the physical layers :meth:`capture` returns by default (validated against the target)"""
    thread_safe: bool = False
    """whether two threads may call it at once (regen.batches_in_flight > 1 overlaps their batches; otherwise the
    engine actor runs one batch at a time whatever Ray Data asks)"""
    launch: Any = None
    """the speculative launch this engine was started with (``engines.sglang.spec.SpeculativeLaunch``), or None:
    serve reads the algorithm from it"""

    @abc.abstractmethod
    def generate_ids(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Generation]:
        """Continue each token-id prompt; the whole batch goes to the engine at once."""

    @abc.abstractmethod
    def capture(
        self, sequences: Sequence[Sequence[int]], layer_ids: Sequence[int] | None = None, *,
        hints: Sequence[CaptureHint | None] | None = None,
    ) -> list[Capture]:
        """Teacher-forced prefill of each sequence; aux states at physical ``layer_ids`` + the final normed state.

        ``hints`` (one per sequence, or None) let an engine that recorded the states during generation return those.
        """

    def render_prompt(self, messages: Sequence[Message], tools: Sequence[dict] | None = None) -> list[int]:
        """Token ids of a conversation followed by the assistant generation prompt, via the target's chat template."""
        return render_chat_ids(self.tokenizer, messages, tools=tools, add_generation_prompt=True)

    def generate(
        self,
        conversations: Sequence[Sequence[Message]],
        sampling: SamplingParams,
        tools: Sequence[Sequence[dict] | None] | None = None,
    ) -> list[Generation]:
        """Continue each conversation's last turn with a new assistant answer."""
        tools = tools or [None] * len(conversations)
        prompts = [self.render_prompt(conv, t) for conv, t in zip(conversations, tools, strict=True)]
        return self.generate_ids(prompts, sampling)

    def start(self) -> None:  # noqa: B027 - optional hook
        """Start now (an engine that starts lazily would otherwise start inside its first request)."""

    def prewarm_capture(self, rows_per_batch: int, batches: int) -> int:
        """Make the host memory ``batches`` batches record into ready before the first batch (bytes made ready; 0 for
        an engine that does not record while generating)."""
        return 0

    def capture_placement(self) -> dict[str, int]:
        """Sequences assembled so far from recorded rows, by how they were placed (empty: nothing recorded)."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release engine resources (GPU memory, subprocesses)."""


def render_chat_ids(
    tokenizer: Any,
    messages: Sequence[Message],
    *,
    tools: Sequence[dict] | None = None,
    add_generation_prompt: bool,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Render with the tokenizer's chat template and tokenize without adding special tokens a second time."""
    text = render_chat_text(tokenizer, messages, tools=tools, add_generation_prompt=add_generation_prompt,
                            template_kwargs=template_kwargs)
    return list(tokenizer.encode(text, add_special_tokens=False))


def decode_texts(tokenizer: Any, seqs: Sequence[Sequence[int]], *, skip_special_tokens: bool,
                 clean_up_tokenization_spaces: bool | None = None) -> list[str]:
    """``[tokenizer.decode(s, ...) for s in seqs]``, in one call into a fast tokenizer's backend where that gives the
    same text (no clean-up pass).

    Regen decodes every answer of a batch at once when the batch's generation returns; at the end of a wave a dozen
    batches do so together under one GIL, and the per-call wrapper of ``decode`` (checking every id) costs more than
    the decoding.
    """
    clean_up = (clean_up_tokenization_spaces if clean_up_tokenization_spaces is not None
                else getattr(tokenizer, "clean_up_tokenization_spaces", True))
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is None or clean_up:
        return [tokenizer.decode(list(s), skip_special_tokens=skip_special_tokens,
                                 clean_up_tokenization_spaces=clean_up_tokenization_spaces) for s in seqs]
    return backend.decode_batch([list(s) for s in seqs], skip_special_tokens=skip_special_tokens)


def render_chat_text(
    tokenizer: Any,
    messages: Sequence[Message],
    *,
    tools: Sequence[dict] | None = None,
    add_generation_prompt: bool,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The chat template's text for ``messages`` (a target without a template is refused with the fix);
    ``template_kwargs``: variables for the template (a request's ``chat_template_kwargs``, e.g. Kimi-K2.5's
    ``thinking`` or Qwen3's ``enable_thinking``), never one of :data:`RESERVED_TEMPLATE_KWARGS`."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the target's tokenizer has no chat_template; regenerating chats needs one "
            "(add `chat_template` to tokenizer_config.json or pick an instruct model)"
        )
    reserved = reserved_template_kwargs(template_kwargs)
    if reserved:
        raise ValueError(f"template variable {reserved[0]!r} is set by the renderer itself")
    kwargs: dict[str, Any] = {**(template_kwargs or {}), "tokenize": False,
                              "add_generation_prompt": add_generation_prompt}
    if tools:
        kwargs["tools"] = list(tools)
    return tokenizer.apply_chat_template(list(messages), **kwargs)


RESERVED_TEMPLATE_KWARGS = ("tokenize", "add_generation_prompt", "tools", "conversation", "messages", "chat_template",
                            "continue_final_message", "documents", "return_tensors", "return_dict", "padding",
                            "truncation", "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask")
"""``apply_chat_template``'s own arguments: a request cannot set them as template variables"""


def reserved_template_kwargs(template_kwargs: Mapping[str, Any] | None) -> list[str]:
    """The names in ``template_kwargs`` that are :data:`RESERVED_TEMPLATE_KWARGS`, sorted (serve refuses them with a
    400 naming the first before rendering; the renderer refuses them for any other caller)."""
    return sorted(set(template_kwargs or ()) & set(RESERVED_TEMPLATE_KWARGS))
