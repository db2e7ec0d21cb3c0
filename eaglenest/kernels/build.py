"""Compile the small-batch linear kernel once per machine and load it with ctypes (no torch extension build).

The kernel is a single C file with no dependency beyond the compiler's intrinsics and OpenMP, so building it takes
about a second; the shared library is cached under ``$EAGLENEST_CACHE/kernels`` (default ``~/.cache/eaglenest``),
keyed by a hash of the source, flags and compiler. Anything missing (not x86-64, no AVX2/FMA, no C compiler) makes
:func:`load_kernel` return ``None`` with the reason in :func:`unavailable_reason`; callers then keep torch's own
linear, so nothing breaks on a machine without the kernel.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("small_batch_linear.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-shared", "-fPIC")
_reason: list[str] = []


def cache_dir() -> Path:
    from eaglenest.engines.tiny import default_cache_dir

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


def _compile(cc: str, out: Path) -> None:
    """Build into a temporary file and rename: concurrent workers never load a half-written library."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        part = Path(tmp) / out.name
        for extra in (("-fopenmp",), ()):  # OpenMP splits the panels over torch's threads; optional
            cmd = [cc, *FLAGS, *extra, str(SOURCE), "-o", str(part)]
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if res.returncode == 0:
                os.replace(part, out)
                return
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {res.stderr.strip()[-500:]}")


@functools.cache
def load_kernel() -> ctypes.CDLL | None:
    """The compiled kernel, or None (and a logged reason) where it cannot run."""
    if os.environ.get("EAGLENEST_CPU_KERNELS", "1") == "0":
        return _unavailable("disabled by EAGLENEST_CPU_KERNELS=0")
    if not _cpu_has_avx2_fma():
        return _unavailable(f"this CPU ({platform.machine()}) lacks AVX2+FMA")
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return _unavailable("no C compiler on PATH (install gcc, or set CC)")
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join((cc, *FLAGS)).encode()).hexdigest()[:16]
    lib_path = cache_dir() / f"small_batch_linear-{key}.so"
    try:
        if not lib_path.is_file():
            _compile(cc, lib_path)
        lib = ctypes.CDLL(str(lib_path))  # CDLL calls release the GIL while the kernel runs
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return _unavailable(f"could not build or load the kernel: {e}")
    fn = lib.small_batch_linear
    fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p,
                   ctypes.c_int]
    fn.restype = None
    return lib


def unavailable_reason() -> str | None:
    """Why :func:`load_kernel` returned None (None when it loaded or was not tried yet)."""
    return _reason[-1] if _reason else None


def _unavailable(reason: str) -> None:
    _reason.append(reason)
    log.info("eaglenest CPU kernel not used: %s; torch's linear is used instead", reason)
    return None
