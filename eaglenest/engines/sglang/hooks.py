"""Capture during generation: forward hooks that run inside SGLang's scheduler process.

Regen needs, for every token of a regenerated sample, the residual stream entering three aux layers and the final
normed state. The prefill capture path gets them from a second, teacher-forced prefill after generation, which costs
about as much GPU time as the generation itself. SGLang computes exactly these states while it generates (the
prompt's in the prefill, each answer token's in the decode step that consumes it), so these hooks record them
there: SGLang's public ``forward_hooks`` server argument loads :func:`capture_hook` by import path inside the
scheduler process and attaches it to decoder layer ``k-1`` (whose output ``hidden + residual`` is the stream
entering physical layer ``k``) and to the final norm (the final normed state); the module paths and what a layer
returns come from the target's architecture record (``eaglenest.targets``: Llama's layers return
``(hidden, residual)``, DeepseekV2's ``(hidden, residual, topk_indices)``). Rows are attributed through the
forward batch's own ``rids``, ``positions`` and ``input_ids``, so nothing depends on scheduling order.

Every forward's rows go GPU -> host on a writer thread: the states by DMA into a ring of shared memory
(``capture_ring``, registered as pinned memory here) where the sink has one, else into the chunk
file; the chunk file (header, ids, positions) is written under a temporary name, then renamed, and the reader takes
chunks in forward order whatever order they land in. ``eaglenest.engines.sglang.capture_sink`` reads them in the engine
actor. Hooks do not fire
inside CUDA-graph replays and a radix-cache hit would skip prompt rows, so the engine that carries these hooks runs
with CUDA graphs and the radix cache off (``sglang_args.generation_capture_kwargs``).

Chunk file layout (little endian): ``u64`` header length, a JSON header (``rids``, ``counts`` per rid in row order,
``rows``, ``width``, ``dtype``, and ``ring``: ``[start, end]`` when the states are in the ring), then ``rows`` int32
input ids, ``rows`` int32 positions, and, without a ring region, ``rows x width`` states (the aux streams in the
configured order, then the final normed state). A hook failure is written to ``error.txt``
in the sink and recording stops; the scheduler keeps serving.
"""

from __future__ import annotations

import json
import os
import queue
import struct
import threading
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from eaglenest.engines.sglang.capture_ring import RingView, RingWriter, ring_exists
from eaglenest.targets import LayerCall, arch_for

HOOK_FACTORY = "eaglenest.engines.sglang.hooks:capture_hook"
LAYER_CALL_DEFAULT = LayerCall()
"""Llama's: ``layer(positions, hidden, forward_batch, residual) -> (hidden, residual)``"""
ERROR_FILE = "error.txt"
CHUNK_SUFFIX = ".chunk"
QUEUE_DEPTH = 16
"""Forwards whose states may wait on the GPU for a writer thread (the hook blocks beyond that: back-pressure)."""
WRITERS = 1
"""Writer threads by default (``target.sglang.capture_writers``). With the ring a writer only starts DMA copies and
writes a small file per forward, so one keeps up; each writer shares the scheduler's GIL and host. (Writing whole
chunk files, one thread managed ~1 GB/s into tmpfs and fell behind the prompts' prefill: three did not.)"""
RING_WAIT_S = 30.0
"""How long a forward waits for room in the ring (a reader that fell behind) before its states go in its chunk file."""


def hook_specs(sink: str | Path, physical_ids: list[int], dtype: str = "bfloat16",
               writers: int = WRITERS, staging_bytes: int = 0, ring: bool = False,
               architecture: str = "LlamaForCausalLM") -> list[dict[str, Any]]:
    """SGLang ``forward_hooks`` entries recording the streams entering ``physical_ids`` and the final normed state.

    Physical id ``k`` is ``output_hidden_states[k]`` in transformers' numbering: the output of decoder layer ``k-1``,
    so ``k >= 1`` (the embeddings, ``k = 0``, have no layer whose output is them; use prefill capture for that).
    ``staging_bytes``: pinned host memory each writer allocates when the engine starts (see :func:`staging_size`);
    ``ring``: the sink folder has a ring (``capture_ring.create_ring``) for the states. ``architecture``: the target's;
    its record (``eaglenest.targets``) names SGLang's layer modules and their call convention.
    """
    if any(k < 1 for k in physical_ids):
        raise ValueError(f"capture during generation needs physical aux ids >= 1 (got {physical_ids}); "
                         f"use target.sglang.capture: prefill for layer 0 (the embeddings)")
    arch = arch_for(architecture)
    common = {"sink": str(sink), "n_aux": len(physical_ids), "dtype": dtype, "writers": int(writers),
              "staging_bytes": int(staging_bytes), "ring": bool(ring), "layer_call": asdict(arch.layer_call)}
    specs = [{"name": f"eaglenest-capture-aux{slot}", "target_modules": [arch.layer_module(k - 1)],
              "hook_factory": HOOK_FACTORY, "config": {**common, "role": "aux", "slot": slot}}
             for slot, k in enumerate(physical_ids)]
    specs.append({"name": "eaglenest-capture-final", "target_modules": [arch.sglang_norm],
                  "hook_factory": HOOK_FACTORY, "config": {**common, "role": "final"}})
    return specs


STAGING_ROWS = 8192
"""Rows of the largest forward a writer's pinned staging is sized for at start: SGLang's chunked prefill on GPUs of
60 GB and more (a larger forward grows it while serving)."""


def staging_size(rows: int, width: int, itemsize: int) -> int:
    """Pinned bytes for a forward of ``rows`` (states, then int32 ids and positions), rounded up to a power of two as
    torch's pinned allocator rounds them anyway, so the whole block is usable."""
    return _pow2(rows * (width * itemsize + 8))


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 1).bit_length()


def chunk_name(seq: int) -> str:
    return f"{seq:012d}{CHUNK_SUFFIX}"


ALIGN = 64
"""The header is padded so the arrays after it start aligned (readers map the file and view it in place)."""


def write_chunk(folder: Path, seq: int, rids: list[str], counts: list[int], ids: torch.Tensor,
                positions: torch.Tensor, states: torch.Tensor, forward_at: float | None = None,
                scheduler: dict[str, float] | None = None, ring: tuple[int, int] | None = None) -> None:
    """One forward's rows as a chunk file (CPU tensors), made visible atomically by a rename. ``forward_at``: when
    the forward recorded them (wall clock), so the reader can tell a writer's lag from its own; ``scheduler``: what
    recording has cost the scheduler so far (seconds, cumulative; see :class:`_Recorder`); ``ring``: the states are
    already in the ring at ``[start, end]`` (only their shape and dtype are read from ``states`` then)."""
    header = json.dumps({"rids": rids, "counts": counts, "rows": int(states.shape[0]),
                         "width": int(states.shape[1]), "dtype": str(states.dtype).removeprefix("torch."),
                         "forward_at": forward_at, "scheduler": scheduler,
                         "ring": list(ring) if ring is not None else None}).encode()
    header += b" " * (-(8 + len(header)) % ALIGN)
    tmp = folder / f".{seq:012d}.tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        f.write(ids.to(torch.int32).contiguous().numpy().tobytes())
        f.write(positions.to(torch.int32).contiguous().numpy().tobytes())
        if ring is None:
            f.write(b"\0" * (-(8 * states.shape[0]) % ALIGN))
            f.write(states.contiguous().view(torch.uint8).numpy())
    os.replace(tmp, folder / chunk_name(seq))


def row_layout(forward_batch: Any, rows: int) -> tuple[list[str], list[int]] | None:
    """Which request each row of a forward belongs to: ``(rids, rows per rid)`` in row order, or None to skip.

    Decode: one row per request. Extend (prefill, chunked prefill, mixed): ``extend_seq_lens_cpu`` rows per request.
    Idle or unattributable forwards (no rids, counts that do not add up) are skipped; the sink then finds those
    positions missing and the engine falls back to a prefill for the affected samples.
    """
    rids = getattr(forward_batch, "rids", None)
    mode = getattr(forward_batch, "forward_mode", None)
    if not rids or mode is None or mode.is_idle():
        return None
    if mode.is_decode():
        counts = [1] * len(rids)
    elif mode.is_extend():
        lens = getattr(forward_batch, "extend_seq_lens_cpu", None)
        if lens is None:
            return None
        counts = [int(n) for n in lens]
    else:
        return None
    if len(counts) != len(rids) or sum(counts) != rows:
        return None
    return [str(r) for r in rids], counts


class _Recorder:
    """Collects one forward's aux streams and final state, and writes them out on a background thread.

    It keeps what recording costs the scheduler (cumulative seconds, written into every chunk's header): ``hooks_s``
    on the forward thread inside the hooks, ``blocked_s`` of it waiting for a writer (a full queue) or for room in
    the ring, ``pinning_s`` the writers spent allocating pinned memory (that call can hold up the launches of the
    forward thread); with a ring, whether it is pinned and how many forwards fell back to chunk files; and the
    forward thread's decode steps (:meth:`_time_decode_step`)."""

    def __init__(self, sink: str, n_aux: int, dtype: str, writers: int = WRITERS, staging_bytes: int = 0,
                 ring: bool = False) -> None:
        self.folder = Path(sink)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.ring: RingWriter | None = None
        self.ring_setup_s = 0.0
        if ring and ring_exists(self.folder):
            t0 = time.perf_counter()
            try:
                view = RingView(self.folder, populate=True)
                view.pin()
                self.ring = RingWriter(view, timeout_s=RING_WAIT_S)
            except Exception:  # noqa: BLE001 - chunk files carry the states instead; the engine must start
                (self.folder / "ring-error.txt").write_text(traceback.format_exc())
            self.ring_setup_s = time.perf_counter() - t0
        self.ring_fallbacks = 0  # forwards whose states went in their chunk file: too large, or no room in time
        self._forward_from = 0.0
        self._last_decode_end: float | None = None
        self.decode_timing = (0, 0.0, 0.0)  # decode steps timed, seconds launching them, seconds between them
        self.n_aux = n_aux
        self.dtype = getattr(torch, dtype)
        self.pending: dict[int, torch.Tensor] = {}
        self.forward_batch: Any = None
        self.seq = 0
        self.failed = False
        self.staging_bytes = staging_bytes
        self.hooks_s = 0.0
        self.blocked_s = 0.0
        self.pinning_s = [0.0] * max(1, writers)  # one entry per writer: no lock on the sum
        self.queue: queue.Queue[tuple | None] = queue.Queue(maxsize=QUEUE_DEPTH)
        self.threads = [threading.Thread(target=self._drain, args=(k,), name=f"eaglenest-capture-writer-{k}",
                                         daemon=True)
                        for k in range(max(1, writers))]
        for t in self.threads:
            t.start()

    def fail(self, where: str) -> None:
        self.failed = True
        self.pending.clear()
        (self.folder / ERROR_FILE).write_text(f"{where}\n{traceback.format_exc()}")

    def aux(self, slot: int, output: Any, call: LayerCall = LAYER_CALL_DEFAULT) -> None:
        if self.failed:
            return
        t0 = time.perf_counter()
        if slot == 0:
            self._forward_from = t0
        try:
            hidden, residual = call.stream(output)
            self.pending[slot] = hidden + residual if residual is not None else hidden.clone()
        except Exception:  # noqa: BLE001 - a recording failure must not take the engine down
            self.fail("aux hook")
        self.hooks_s += time.perf_counter() - t0

    def final(self, output: Any) -> None:
        if self.failed:
            return
        t0 = time.perf_counter()
        try:
            self._final(output)
        except Exception:  # noqa: BLE001
            self.fail("final hook")
        self.hooks_s += time.perf_counter() - t0

    def _time_decode_step(self, fb: Any) -> None:
        """The scheduler thread's time per decode step, from the hooks' clock: launching the layers from the first aux
        layer to the final norm, and from one step's final norm to the next one's first aux layer (the scheduler's
        bookkeeping, and waits for the GPU). A CPU-bound scheduler shows here as steps whose two parts add up to the
        step time; contention for its CPU or GIL lengthens both."""
        now = time.perf_counter()
        if not fb.forward_mode.is_decode():
            self._last_decode_end = None
            return
        n, launch, between = self.decode_timing
        if self._last_decode_end is not None:
            between += self._forward_from - self._last_decode_end
            n += 1
            launch += now - self._forward_from
        self.decode_timing = (n, launch, between)
        self._last_decode_end = now

    def costs(self) -> dict[str, float]:
        """What recording has cost the scheduler so far (seconds; ``ring_pinned``: 1 when the ring is pinned)."""
        out = {"hooks_s": round(self.hooks_s, 4), "blocked_s": round(self.blocked_s, 4),
               "pinning_s": round(sum(self.pinning_s), 4)}
        n, launch, between = self.decode_timing
        if n:
            out.update({"decode_steps": float(n), "decode_launch_ms": round(1e3 * launch / n, 2),
                        "decode_between_ms": round(1e3 * between / n, 2)})
        if self.ring is not None:
            out["ring_setup_s"] = round(self.ring_setup_s, 3)
            out["ring_pinned"] = float(self.ring.view.pinned)
            out["ring_fallbacks"] = float(self.ring_fallbacks)
        return out

    def _final(self, output: Any) -> None:
        pending, self.pending = self.pending, {}
        normed = output[0] if isinstance(output, tuple) else output
        fb = self.forward_batch
        self.forward_batch = None
        if fb is None or len(pending) != self.n_aux:
            return
        rows = int(normed.shape[0])
        layout = row_layout(fb, rows)
        if layout is None:
            return
        self._time_decode_step(fb)
        states = torch.cat([pending[s] for s in range(self.n_aux)] + [normed], dim=-1).to(self.dtype)
        ids = fb.input_ids[:rows].to(torch.int32, copy=True)  # SGLang reuses its buffers: the writer needs its own
        positions = fb.positions[:rows].to(torch.int32, copy=True)
        event = torch.cuda.Event() if states.is_cuda else None
        if event is not None:
            event.record()
        region = None
        if self.ring is not None:  # in forward order, here: the reader hands space back in that order
            t0 = time.perf_counter()
            region = self.ring.allocate(states.numel() * states.element_size())
            waited = time.perf_counter() - t0
            if waited > 0.001:
                self.blocked_s += waited
            self.ring_fallbacks += region is None
        item = (self.seq, layout, ids, positions, states, event, time.time(), self.costs(), region)
        try:
            self.queue.put_nowait(item)
        except queue.Full:  # back-pressure: the forward thread waits for a writer
            t0 = time.perf_counter()
            self.queue.put(item)
            self.blocked_s += time.perf_counter() - t0
        self.seq += 1

    def close(self, timeout_s: float = 60.0) -> None:
        """Let the writers finish the forwards queued so far, then stop them (in SGLang the scheduler process ends
        with its daemon writers; a benchmark driving a recorder itself stops it here)."""
        for _ in self.threads:
            self.queue.put(None)
        for t in self.threads:
            t.join(timeout=timeout_s)

    def _pinned(self, writer: int, nbytes: int) -> torch.Tensor:
        t0 = time.perf_counter()
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.pinning_s[writer] += time.perf_counter() - t0
        return buf

    def _drain(self, writer: int = 0) -> None:
        copy_stream = None
        # pinned, reused: a fresh pinned allocation per forward costs more, and one while serving can hold up the
        # scheduler's launches, so each writer allocates it for the largest forward expected while the engine starts
        staging: torch.Tensor | None = None
        if self.staging_bytes and torch.cuda.is_available():
            try:
                staging = self._pinned(writer, self.staging_bytes)
            except Exception:  # noqa: BLE001 - allocated on demand instead
                staging = None
        while True:
            item = self.queue.get()
            if item is None:
                return
            seq, (rids, counts), ids, positions, states, event, forward_at, costs, region = item
            try:
                nbytes = states.numel() * states.element_size()
                in_ring = (self.ring.view.region(region[0], nbytes).view(states.dtype).view(states.shape)
                           if region is not None and self.ring is not None else None)
                if event is None:
                    host_ids, host_pos, host = ids, positions, states
                    if in_ring is not None:
                        in_ring.copy_(states)
                else:
                    event.synchronize()
                    if copy_stream is None:
                        copy_stream = torch.cuda.Stream(device=states.device)
                    staged = 0 if in_ring is not None else nbytes  # with a ring region, only ids and positions
                    need = staged + 8 * ids.numel()
                    if staging is None or staging.numel() < need:
                        staging = None  # back to torch's pinned cache before the larger one is allocated
                        staging = self._pinned(writer, _pow2(max(need, 64 << 20)))
                    host = in_ring if in_ring is not None else staging[:nbytes].view(states.dtype).view(states.shape)
                    host_ids = staging[staged:staged + 4 * ids.numel()].view(torch.int32)
                    host_pos = staging[staged + 4 * ids.numel():need].view(torch.int32)
                    # every copy on this thread's own stream: a plain .cpu() of the ids would queue behind the forward
                    # running on the compute stream, so the writer would manage one chunk per forward, never a backlog
                    with torch.cuda.stream(copy_stream):
                        host.copy_(states, non_blocking=True)
                        host_ids.copy_(ids, non_blocking=True)
                        host_pos.copy_(positions, non_blocking=True)
                        copy_stream.synchronize()
                write_chunk(self.folder, seq, rids, counts, host_ids, host_pos, host, forward_at, costs,
                            ring=region if in_ring is not None else None)
            except Exception:  # noqa: BLE001
                self.fail("writer")
            del states, ids, positions


_RECORDERS: dict[str, _Recorder] = {}
_LOCK = threading.Lock()


def _recorder(cfg: dict[str, Any]) -> _Recorder:
    with _LOCK:
        rec = _RECORDERS.get(cfg["sink"])
        if rec is None:
            rec = _RECORDERS[cfg["sink"]] = _Recorder(cfg["sink"], int(cfg["n_aux"]), cfg.get("dtype", "bfloat16"),
                                                      int(cfg.get("writers", WRITERS)),
                                                      int(cfg.get("staging_bytes", 0)), bool(cfg.get("ring", False)))
        return rec


def _is_primary_rank() -> bool:
    """Under tensor parallelism every rank holds the full (all-reduced) residual stream: rank 0 records."""
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def capture_hook(config: dict[str, Any]) -> Any:
    """SGLang hook factory (``forward_hooks[].hook_factory``): one hook per spec of :func:`hook_specs`."""
    if not _is_primary_rank():
        return lambda module, args, output: None
    rec = _recorder(config)
    if config["role"] == "aux":
        slot = int(config["slot"])
        call = LayerCall(**config["layer_call"]) if config.get("layer_call") else LAYER_CALL_DEFAULT
        fb_arg = call.forward_batch_arg

        def aux_hook(module: Any, args: tuple, output: Any) -> None:
            # the layer's call convention (eaglenest.targets) says where its ForwardBatch is; every aux hook of one
            # forward sees the same batch, so the last one to fire before the final norm decides
            rec.forward_batch = args[fb_arg] if len(args) > fb_arg else None
            rec.aux(slot, output, call)

        return aux_hook

    def final_hook(module: Any, args: tuple, output: Any) -> None:
        rec.final(output)

    return final_hook
