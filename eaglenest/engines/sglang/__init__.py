"""The SGLang engine (GPU): offline ``sglang.Engine`` for generation, capture while generating (forward hooks and
the ring of shared memory), the in-process prefill capture runner, streams, and the speculative launch.

SGLang itself is imported lazily (``symbols.require_sglang``): every module here imports on a machine without it, so
the CPU tests can check the arguments, hooks and transport against SGLang's real call conventions. Every SGLang
internal used is listed in ``symbols.SGLANG_INTERNALS``. The engine is ``engine.SGLangEngine``.
"""
