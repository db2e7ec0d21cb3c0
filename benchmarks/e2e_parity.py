"""The states regen stored vs the target's own prefill capture of the same sequences, as one step of gpu_e2e.sh.

Regen records hidden states while SGLang generates (forward hooks in its scheduler, batched decode kernels) and stores
them, at Kimi's widths, in fp8. This step reads the first ``E2E_PARITY_SEQUENCES`` samples back from regen's shards
exactly as training does and compares them, at every position training reads, with a teacher-forced prefill of the
same token ids on the same target (SGLang's ``SGLangCaptureRunner`` on the GPU; transformers on the CPU), at the taps
the manifest names and, as a control, one layer further on (back, where the last tap is the last layer): an
off-by-one tap must fail the tolerance.

Two figures per state: against the reference as it is (fp8 storage alone costs ~2-3% relative), and against the
reference put through the same storage (``tensor_to_bytes`` then ``bytes_to_tensor``), which leaves only what differs
between decoding and prefilling in bf16: the latter is held to the capture check's bf16 tolerance (0.03).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.gpu_sglang import read_positions, worst_rel_errs  # noqa: E402 - the GPU checks' one definition

TOLERANCE = 3e-2
"""bf16 kernels of a batched decode vs a prefill differ in rounding (the capture check's tolerance)"""


def stored_samples(data_dir: Path, n: int) -> tuple[Any, list[dict[str, Any]]]:
    """The manifest and the first ``n`` samples of regen's shards: ids, loss mask, aux ``[T, 3H]`` and final
    ``[T, H]`` states decoded as training decodes them (fp8 -> bf16)."""
    import pyarrow.parquet as pq

    from eaglenest.contracts.shards import bytes_to_tensor, read_manifest, shard_files

    manifest = read_manifest(data_dir)
    h, out = manifest.hidden_size, []
    for shard in shard_files(data_dir):
        table = pq.read_table(shard, columns=["input_ids", "loss_mask", "aux_hidden_states", "last_hidden_state"])
        for row in table.slice(0, n - len(out)).to_pylist():
            out.append({"input_ids": list(row["input_ids"]), "loss_mask": list(row["loss_mask"]),
                        "aux": bytes_to_tensor(row["aux_hidden_states"], manifest.dtype, 3 * h, 3),
                        "last": bytes_to_tensor(row["last_hidden_state"], manifest.dtype, h, 1)})
            if len(out) == n:
                return manifest, out
    if not out:
        raise FileNotFoundError(f"no samples in {data_dir}/shards: run regen first")
    return manifest, out


def as_stored(t: torch.Tensor, dtype: str, states: int) -> torch.Tensor:
    """``t`` after the shards' storage round trip (what regen would have written for it)."""
    from eaglenest.contracts.shards import bytes_to_tensor, tensor_to_bytes

    return bytes_to_tensor(tensor_to_bytes(t.cpu(), dtype, states), dtype, t.shape[-1], states)


def compare(samples: list[dict[str, Any]], reference: list[Any], shifted: list[Any], dtype: str) -> dict[str, Any]:
    """Worst relative errors over ``samples`` at the positions training reads (see the module docstring)."""

    def row(s: dict[str, Any], ref: Any, off: Any) -> dict[str, tuple[Any, Any]]:
        read = read_positions(len(s["input_ids"]), s["loss_mask"])
        aux, last = s["aux"][read].float(), s["last"][read].float()
        ref_aux, ref_last = ref.aux_hidden_states[read].float().cpu(), ref.last_hidden_state[read].float().cpu()
        off_aux = off.aux_hidden_states[read].float().cpu()
        return {"aux": (aux, as_stored(ref_aux, dtype, 3).float()),
                "last": (last, as_stored(ref_last, dtype, 1).float()),
                "aux_raw": (aux, ref_aux), "last_raw": (last, ref_last),
                "control_aux": (aux, as_stored(off_aux, dtype, 3).float())}

    worst = worst_rel_errs(row(*t) for t in zip(samples, reference, shifted, strict=True))
    rounded = {k: round(v, 5) for k, v in worst.items()}
    ok = worst["aux"] <= TOLERANCE and worst["last"] <= TOLERANCE and worst["control_aux"] > TOLERANCE
    return {**rounded, "tolerance": TOLERANCE, "ok": ok}


def sglang_reference(e2e: ModuleType, manifest: Any) -> tuple[Callable[..., list[Any]], Callable[[], None]]:
    """SGLang's prefill capture on the run's target (beside serve's engine where the run has side steps: its share
    then ``e2e.PARITY_MEM_FRACTION``, its KV pool capped)."""
    from eaglenest.config import load_config
    from eaglenest.engines.sglang.args import capture_server_kwargs
    from eaglenest.engines.sglang.capture import SGLangCaptureRunner

    cfg = load_config(e2e.REGEN_CONFIG).target.sglang.model_copy(
        update={"capture_mem_fraction_static": e2e.PARITY_MEM_FRACTION})
    runner = SGLangCaptureRunner(capture_server_kwargs(str(e2e.MODEL), cfg, dtype="bfloat16", max_total_tokens=16384),
                                 architecture=e2e.target_facts()["architecture"], num_layers=manifest.num_layers,
                                 max_tokens=4096)
    return runner.capture, runner.close


def transformers_reference(e2e: ModuleType) -> tuple[Callable[..., list[Any]], Callable[[], None]]:
    """The CPU run's reference: transformers' hidden states (index = physical id; the last one is normed)."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(e2e.MODEL), dtype=torch.float32).eval()

    @torch.no_grad()
    def capture(seqs: Sequence[Sequence[int]], taps: Sequence[int]) -> list[Any]:
        out = []
        for s in seqs:
            hs = model(torch.tensor([list(s)]), output_hidden_states=True).hidden_states
            out.append(SimpleNamespace(aux_hidden_states=torch.cat([hs[k][0] for k in taps], dim=-1),
                                       last_hidden_state=hs[-1][0]))
        return out

    return capture, lambda: None


def run(e2e: ModuleType, n: int) -> dict[str, Any]:
    """The step: regen's stored states vs the reference capture (taps, and taps + 1 as the control)."""
    manifest, samples = stored_samples(e2e.REGEN_OUT, n)
    taps = [int(k) for k in manifest.aux_layer_ids]
    shift = 1 if max(taps) + 1 < manifest.num_layers else -1  # the control's taps: one layer on (or back)
    control_taps = [k + shift for k in taps]
    seqs = [s["input_ids"] for s in samples]
    capture, close = sglang_reference(e2e, manifest) if e2e.gpu() else transformers_reference(e2e)
    try:
        reference, shifted = capture(seqs, taps), capture(seqs, control_taps)
    finally:
        close()
    return {"status": "ok", "sequences": len(samples), "tokens": sum(len(s) for s in seqs), "taps": taps,
            "control_taps": control_taps,
            "storage": manifest.dtype, "engine": manifest.engine,
            "reference": "sglang prefill capture" if e2e.gpu() else "transformers hidden states",
            **compare(samples, reference, shifted, manifest.dtype)}
