"""Test-only shims that let sglang 0.5.14's config code import on a CPU box (reference/sglang.md §G).

Only the contract venv (.ci/sglang_contract.sh) uses them; they replace three things a CPU box lacks and the tested
code paths never run: triton kernels (sglang's own stub), torchvision (a mock package; a real torchvision wheel drags
in a CUDA torch), and torch.compile at import time (a no-op decorator, since inductor chokes on the triton stub).
Call ``install()`` before the first ``import sglang``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

_INSTALLED = False


class _MockModule(types.ModuleType):
    """A module whose attributes are further mocks; calling one returns a mock (or passes a function through)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__path__: list[str] = []
        self.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        child = _MockModule(f"{self.__name__}.{attr}")
        setattr(self, attr, child)
        return child

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return self


class _TorchvisionFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers every ``import torchvision[.x]`` with a mock module."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _MockModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def _no_register(*args: Any, **kwargs: Any) -> None:
    return None


def _no_compile(fn: Any = None, *args: Any, **kwargs: Any) -> Any:
    """``torch.compile`` stand-in: returns the function unchanged (also in decorator-factory form)."""
    if fn is None or not callable(fn):
        return lambda f: f
    return fn


def _load_triton_stub() -> types.ModuleType:
    """sglang's own triton stub, loaded by file path: importing the sglang package would pull triton first."""
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("sglang is not installed in this venv; run .ci/sglang_contract.sh")
    path = f"{list(spec.submodule_search_locations)[0]}/_triton_stub.py"
    stub_spec = importlib.util.spec_from_file_location("_eaglenest_sglang_triton_stub", path)
    assert stub_spec is not None and stub_spec.loader is not None
    module = importlib.util.module_from_spec(stub_spec)
    stub_spec.loader.exec_module(module)
    return module


def install() -> None:
    """Install the three shims (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    import torch
    import transformers  # noqa: F401 - imported first so it records torchvision as absent, not as the mock

    if "torchvision" in sys.modules:
        raise RuntimeError("torchvision was imported before the sglang shims; install() must run first")
    sys.meta_path.insert(0, _TorchvisionFinder())
    # transformers 5.8 (sglang's pin) makes AutoImageProcessor a dummy that raises without torchvision; sglang only
    # registers its multimodal image processors with it at import time, which the contract does not exercise.
    import transformers.utils.import_utils as iu

    original = iu.DummyObject.__getattribute__

    def dummy_getattribute(cls: Any, key: str) -> Any:
        if key == "register":
            return _no_register
        return original(cls, key)

    iu.DummyObject.__getattribute__ = dummy_getattribute  # type: ignore[method-assign]
    _load_triton_stub().install()
    torch.compile = _no_compile  # type: ignore[assignment]
    _INSTALLED = True


def init_cpu_model_parallel() -> None:
    """A one-process gloo group and sglang's parallel state: what constructing an sglang model on the CPU needs
    (call after :func:`install`; once per process)."""
    import socket

    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(1, 1)
