"""Build the tiny target afresh on this machine's CPU and print its weight digest beside what decides it (issue #16).

    python tools/tiny_target_hash.py            # from the repository root; needs torch, transformers, tokenizers

Prints the CPU model and ISA flags, the torch / transformers / tokenizers versions, the digest of the token ids the
pre-training reads (the BPE tokenizer's part) and ``weights_digest`` of the built model, and compares both with
the digests tests/e2e/test_tiny_target.py pins; exit status 0 when both match. CUDA is hidden (the build is CPU-only).
eaglenest's config needs pydantic; where it is missing, a stand-in just big enough to read the spec's defaults is used.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import re
import sys
import tempfile
import time
import types
from pathlib import Path

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch loads
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ISA_FLAGS = ("sse4_2", "avx", "fma", "avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


def _pydantic_stand_in() -> types.ModuleType:
    """Enough of pydantic for eaglenest.config's classes to be defined and built with their defaults."""

    class FieldInfo:
        def __init__(self, default=None, default_factory=None, **_):
            self.default, self.default_factory = default, default_factory

    class BaseModel:
        def __init__(self, **values):
            for cls in reversed(type(self).__mro__):
                for name in inspect.get_annotations(cls):
                    if name == "model_config":
                        continue
                    d = getattr(cls, name, None)
                    if isinstance(d, FieldInfo):
                        d = d.default_factory() if d.default_factory else d.default
                    setattr(self, name, values.get(name, d))

        def model_dump(self) -> dict:
            return {k: v for k, v in vars(self).items()}

    def decorator(*_, **__):
        return lambda f: f

    mod = types.ModuleType("pydantic")
    mod.BaseModel, mod.ConfigDict, mod.ValidationError = BaseModel, dict, type("ValidationError", (ValueError,), {})
    mod.Field = FieldInfo
    mod.field_validator = mod.model_validator = decorator
    return mod


def load_spec():
    """The default TinyTargetSpec (through the stand-in if pydantic is not installed)."""
    try:
        import pydantic  # noqa: F401
    except ImportError:
        sys.modules["pydantic"] = _pydantic_stand_in()
    from eaglenest.config import TinyTargetSpec

    return TinyTargetSpec()


def cpu_facts() -> tuple[str, list[str]]:
    """Model name and the ISA flags (of ISA_FLAGS) from /proc/cpuinfo."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = re.search(r"^model name\s*:\s*(.*)$", text, re.M)
    flags = re.search(r"^flags\s*:\s*(.*)$", text, re.M)
    have = set(flags.group(1).split()) if flags else set()
    return (name.group(1) if name else platform.processor()), [f for f in ISA_FLAGS if f in have]


def pinned(name: str) -> str | None:
    """A digest that tests/e2e/test_tiny_target.py pins."""
    m = re.search(rf'^{name} = "([0-9a-f]+)"', (REPO / "tests/e2e/test_tiny_target.py").read_text(), re.M)
    return m.group(1) if m else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="build here (default: a temporary folder, removed afterwards)")
    ap.add_argument("--spec-only", action="store_true", help="print the default spec as JSON and exit")
    args = ap.parse_args()
    spec = load_spec()
    if args.spec_only:
        print(json.dumps(spec.model_dump(), sort_keys=True))
        return 0

    import tokenizers
    import torch
    import transformers
    from transformers import AutoTokenizer

    from eaglenest.engines.tiny import BUILDER_VERSION, build_tiny_target, corpus_ids_digest, weights_digest

    name, flags = cpu_facts()
    print(f"cpu:          {name} ({os.cpu_count()} logical cores)")
    print(f"isa flags:    {' '.join(flags) or '?'}")
    print(f"torch:        {torch.__version__} (ATen CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads)")
    print(f"transformers: {transformers.__version__}; tokenizers: {tokenizers.__version__}; python "
          f"{platform.python_version()}; builder version {BUILDER_VERSION}")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        t0 = time.perf_counter()
        build_tiny_target(out, spec)
        took = time.perf_counter() - t0
        tokens = corpus_ids_digest(AutoTokenizer.from_pretrained(str(out)))
        digest = weights_digest(out)
    print(f"build:        {took:.1f} s")
    ok = True
    for label, got, name in (("corpus ids", tokens, "TINY_CORPUS_IDS_SHA256"),
                             ("weights", digest, "TINY_WEIGHTS_SHA256")):
        want = pinned(name)
        ok &= got == want
        print(f"{label + ' sha256:':19} {got}\n{'pinned:':19} {want} -> {'MATCH' if got == want else 'DIFFERENT'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
