"""Which ``config.json`` keys carry a drafter's aux layer ids for which engine, and which key each engine reads.

The two engines read different keys (measured on the installed packages, not assumed):

- **SGLang 0.5.14** reads only ``eagle_config.eagle_aux_hidden_state_layer_ids`` (``ModelRunner.__init__``) and applies
  its own rule to it (``eaglenest.targets``: +1 for Llama-style targets);
- **vLLM 0.32.0** reads the top-level ``eagle_aux_hidden_state_layer_ids`` first, as physical ids. Its V1 model
  runner (``GPUModelRunner._get_eagle3_aux_layers_from_config``; the CPU runner) falls back to ``eagle_config``'s key;
  the V2 runner (``get_eagle3_aux_layers_from_config``, vLLM's default on a GPU with Triton) does not read
  ``eagle_config``'s key at all and falls back to the target's default taps.

So one folder serves both: ``eagle_config`` carries SGLang's ids and the top level carries vLLM's. That is the
``both`` format, the default. ``sglang`` writes only ``eagle_config`` (what eaglenest wrote before; vLLM then takes
SGLang's ids as physical and captures the wrong layers, silently), ``vllm`` writes physical ids in both places.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

Format = Literal["both", "sglang", "vllm"]
FORMATS: tuple[str, ...] = ("both", "sglang", "vllm")
DEFAULT_FORMAT: Format = "both"
IDS_KEY = "eagle_aux_hidden_state_layer_ids"
"""the key's name, at the top level (vLLM) and inside ``eagle_config`` (SGLang, vLLM's V1 runner's fallback)"""

WRITTEN: dict[str, dict[str, str]] = {
    "both": {"eagle_config": "sglang", "top": "vllm"},
    "sglang": {"eagle_config": "sglang"},
    "vllm": {"eagle_config": "vllm", "top": "vllm"},
}
"""format -> {where ids are written ("eagle_config" / "top"): the engine whose convention they are in}"""

FORMAT_ENGINES: dict[str, tuple[str, ...]] = {"both": ("sglang", "vllm"), "sglang": ("sglang",), "vllm": ("vllm",)}
"""the engines each format is written for"""


class FormatError(ValueError):
    """An export format eaglenest does not write."""


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise FormatError(f"unknown export format {fmt!r}; use one of {list(FORMATS)} (both: ids SGLang and vLLM "
                          f"each read correctly, in one folder)")
    return fmt


def eagle_config_convention(fmt: str | None) -> str:
    """The engine convention of ``eagle_config``'s ids in an export of ``fmt`` (unknown or older: SGLang's)."""
    return WRITTEN.get(fmt or "sglang", WRITTEN["sglang"])["eagle_config"]


def id_keys(fmt: str, ids_for: Mapping[str, Sequence[int]]) -> dict[str, Any]:
    """The config.json entries of ``fmt``: ``{"eagle_config": {...}, IDS_KEY: [...]?}`` from each engine's ids."""
    where = WRITTEN[check_format(fmt)]
    out: dict[str, Any] = {"eagle_config": {IDS_KEY: [int(i) for i in ids_for[where["eagle_config"]]],
                                            "use_aux_hidden_state": True}}
    if "top" in where:
        out[IDS_KEY] = [int(i) for i in ids_for[where["top"]]]
    return out


def written_ids(config: Mapping[str, Any]) -> dict[str, list[int] | None]:
    """The ids a config.json carries, by place: ``{"top": ..., "eagle_config": ...}`` (None where absent)."""
    top = config.get(IDS_KEY)
    inner = (config.get("eagle_config") or {}).get(IDS_KEY)
    return {"top": None if not top else [int(i) for i in top],
            "eagle_config": None if not inner else [int(i) for i in inner]}


def sglang_reads(config: Mapping[str, Any]) -> tuple[list[int] | None, str]:
    """(ids, where) SGLang 0.5.14 takes from a drafter's config.json: ``eagle_config``'s only (None: its defaults)."""
    ids = written_ids(config)["eagle_config"]
    return ids, (f"eagle_config.{IDS_KEY}" if ids is not None else f"no eagle_config.{IDS_KEY}")


def vllm_reads(config: Mapping[str, Any]) -> dict[str, tuple[list[int] | None, str]]:
    """(ids, where) each vLLM 0.32 model runner takes from a drafter's config.json (None: the target's default taps):
    ``{"v1": ..., "v2": ...}``. They agree whenever the top-level key is present."""
    w = written_ids(config)
    if w["top"] is not None:
        both = (w["top"], f"top-level {IDS_KEY}")
        return {"v1": both, "v2": both}
    v1 = (w["eagle_config"], f"eagle_config.{IDS_KEY}") if w["eagle_config"] is not None else (None, "defaults")
    return {"v1": v1, "v2": (None, f"the target's default taps (no top-level {IDS_KEY})")}
