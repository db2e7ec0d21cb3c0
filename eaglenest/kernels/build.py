"""Build the small-batch linear kernel with torch's own extension builder and load it as a torch operator.

``torch.utils.cpp_extension.load`` compiles ``small_batch_linear.cpp`` once per machine (about 7-10 s on a 2-core
box: the file includes only torch's operator-registration headers) into ``$EAGLENEST_CACHE/kernels`` (default
``~/.cache/eaglenest``), keyed by a hash of the source, flags, compiler and torch version; later processes load the
cached library with ``torch.ops.load_library``. The library registers ``torch.ops.eaglenest.small_batch_linear``.
Anything missing (not x86-64, no AVX2/FMA, no C++ compiler or ninja) makes :func:`load_kernel` return ``None`` with
the reason in :func:`unavailable_reason`; callers then keep torch's own linear, so nothing breaks on a machine
without the kernel.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("small_batch_linear.cpp")
FLAGS = ("-O3", "-mavx2", "-mfma")
OPENMP = ("-fopenmp",)  # OpenMP splits the panels over torch's threads; optional
_reason: list[str] = []


def cache_dir() -> Path:
    from eaglenest.config import default_cache_dir

    return default_cache_dir() / "kernels"


def _cpu_has_avx2_fma() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):  # not Linux: trust torch's own dispatch probe
        import torch

        return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    words = set(flags.split())
    return {"avx2", "fma"} <= words


def _ninja() -> str | None:
    """ninja on PATH, or the one pip put next to this interpreter (a venv used without activating it)."""
    found = shutil.which("ninja")
    if found is None:
        found = shutil.which("ninja", path=str(Path(sys.executable).parent))
        if found is not None:
            os.environ["PATH"] = f"{Path(found).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return found


def _build(key: str) -> None:
    """Compile the kernel unless a cached build exists, then load it (it registers its operator on load)."""
    import torch

    build_dir = cache_dir() / f"small_batch_linear-{key}"
    for extra in (OPENMP, ()):
        lib = build_dir / f"eaglenest_small_batch_linear_{key}{'' if extra else '_noomp'}.so"
        if lib.is_file():  # built before: load it without asking ninja (which costs seconds)
            torch.ops.load_library(str(lib))
            return
    from torch.utils.cpp_extension import load

    build_dir.mkdir(parents=True, exist_ok=True)  # cpp_extension locks it: concurrent workers build once
    last: Exception | None = None
    for extra in (OPENMP, ()):
        try:
            load(name=f"eaglenest_small_batch_linear_{key}{'' if extra else '_noomp'}", sources=[str(SOURCE)],
                 extra_cflags=[*FLAGS, *extra], extra_ldflags=list(extra), build_directory=str(build_dir),
                 is_python_module=False, verbose=False)
            return
        except Exception as e:  # noqa: BLE001 - a build failure of any kind means: fall back to torch's linear
            last = e
    raise RuntimeError(str(last)[-500:])


@functools.cache
def load_kernel() -> Callable | None:
    """``torch.ops.eaglenest.small_batch_linear`` (x [M, K], packed, n, threads) -> [M, n], or None (and a logged
    reason) where it cannot run."""
    if os.environ.get("EAGLENEST_CPU_KERNELS", "1") == "0":
        return _unavailable("disabled by EAGLENEST_CPU_KERNELS=0")
    if not _cpu_has_avx2_fma():
        return _unavailable(f"this CPU ({platform.machine()}) lacks AVX2+FMA")
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        return _unavailable("no C++ compiler on PATH (install g++, or set CXX)")
    if _ninja() is None:
        return _unavailable("ninja is not installed (torch's extension builder needs it: apt install ninja-build "
                            "or pip install ninja)")
    import torch

    os.environ.setdefault("CXX", cxx)
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join((cxx, *FLAGS, torch.__version__)).encode()).hexdigest()[:16]
    try:
        _build(key)
        return torch.ops.eaglenest.small_batch_linear
    except (OSError, RuntimeError, AttributeError) as e:
        return _unavailable(f"could not build or load the kernel: {e}")


def unavailable_reason() -> str | None:
    """Why :func:`load_kernel` returned None (None when it loaded or was not tried yet)."""
    return _reason[-1] if _reason else None


def _unavailable(reason: str) -> None:
    _reason.append(reason)
    log.info("eaglenest CPU kernel not used: %s; torch's linear is used instead", reason)
    return None
