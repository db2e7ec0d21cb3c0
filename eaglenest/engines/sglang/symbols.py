"""The sglang names eaglenest may touch, and the one gate through which they are imported.

Its own module so that the backend (``eaglenest.engines.sglang.engine``) and the capture runner
(``eaglenest.engines.sglang.capture``) both reach sglang through it without importing each other. What each name is
used for is listed in ``eaglenest.engines.sglang.engine``'s docstring; upgrading sglang means re-reading exactly these.
"""

from __future__ import annotations

import importlib
from typing import Any

from eaglenest.engines.sglang.args import SGLANG_VERSION, SGLangVersionError, check_sglang_version

SGLANG_INTERNALS: tuple[str, ...] = (
    "sglang:Engine",
    "sglang:__version__",
    "sglang.srt.server_args:ServerArgs",
    "sglang.srt.server_args:PortArgs",
    "sglang.srt.configs.model_config:ModelConfig",
    "sglang.srt.model_executor.model_runner:ModelRunner",
    "sglang.srt.managers.schedule_batch:Req",
    "sglang.srt.managers.schedule_batch:ScheduleBatch",
    "sglang.srt.model_executor.forward_batch_info:ForwardBatch",
    "sglang.srt.speculative.spec_info:SpeculativeAlgorithm",
    "sglang.srt.sampling.sampling_params:SamplingParams",
    "sglang.srt.layers.moe:initialize_moe_config",
    "sglang.srt.layers.quantization.fp8_utils:initialize_fp8_gemm_config",
    "sglang.srt.layers.quantization.fp4_utils:initialize_fp4_gemm_config",
)
"""The only sglang names eaglenest uses (module:attribute); see the module docstring for the attributes used on them."""

def installed_sglang_version() -> str | None:
    """The installed sglang version from package metadata (does not import sglang)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def require_sglang() -> None:
    """Fail early and clearly unless the pinned sglang is installed."""
    check_sglang_version(installed_sglang_version())


def sglang_symbol(name: str) -> Any:
    """Import one listed sglang name (``module:attr``); anything not in SGLANG_INTERNALS is refused."""
    if name not in SGLANG_INTERNALS:
        raise KeyError(f"{name} is not in SGLANG_INTERNALS; list it there (with what it is used for) before using it")
    require_sglang()
    module, attr = name.split(":")
    mod = importlib.import_module(module)
    if not hasattr(mod, attr):
        raise SGLangVersionError(f"sglang {installed_sglang_version()} has no {name}; this backend needs "
                                 f"sglang=={SGLANG_VERSION}")
    return getattr(mod, attr)


def server_arg_fields() -> frozenset[str]:
    """The keyword arguments ``sglang.Engine`` accepts: ``ServerArgs``' dataclass fields."""
    import dataclasses

    return frozenset(f.name for f in dataclasses.fields(sglang_symbol("sglang.srt.server_args:ServerArgs")))
