"""The hidden-state shard contract between regen (writer) and drafter (reader).

A regen output folder holds ``shards/*.parquet`` (one row per sample) and ``manifest.json``. Hidden states are
stored as raw row-major bytes (``[T, 3H]`` aux, ``[T, H]`` final normed state) in the manifest's dtype, so storage is
exactly ``8 * H`` bytes per token in bf16 and reading back needs no float parsing.

``source_id`` (the record's own id in its dataset, or ``<file>#<index>``) was added after the first shards were
written: it is the last column, nullable, and readers must not require it (older shards lack it; same
``SCHEMA_VERSION``, since nothing that reads hidden states depends on it).

``float8_e4m3fn`` storage (half of bf16: 4·H + 4 bytes per token) scales every token's every state (each aux layer
and the final state: ``states`` per blob) by its own power of two, 2^e with e = ceil(log2(amax / 448)), so the
largest value lands at e4m3's maximum and dividing is exact; the blob holds the ``[T, width]`` fp8 values followed
by the ``[T, states]`` int8 exponents (``FP8_SCALE_LAYOUT``). Reading gives bf16 (:func:`compute_dtype`). Powers of
two instead of float scales: one byte each and no rounding of their own; the error is e4m3's alone (<= 2^-4
relative per value).

The training data path does not decode fp8 on the host: :func:`fp8_parts` splits a blob into its payload and
exponents, which travel to the GPU as they are (1 byte per value instead of bf16's 2), and :func:`dequantize_fp8`
decodes them there. :func:`bytes_to_tensor` is the same two functions on the CPU, so both paths give the same bits.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch
from pydantic import BaseModel, ConfigDict, Field

SCHEMA_VERSION = 1

DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
                                  "float8_e4m3fn": torch.float8_e4m3fn}
FP8 = "float8_e4m3fn"
FP8_MAX = 448.0
FP8_SCALE_LAYOUT = "per_token_state_pow2_int8"
"""one int8 exponent per token and state, after the values (see the module docstring)"""
STATES_PER_TOKEN = 4
"""three aux layers + the final normed state"""


def compute_dtype(dtype: str) -> torch.dtype:
    """The dtype readers get back: the storage dtype, except fp8, which is dequantised to bf16."""
    return torch.bfloat16 if dtype == FP8 else DTYPES[dtype]


def blob_bytes(dtype: str, tokens: int, width: int, states: int = 1) -> int:
    """Exact size of one sample's blob of ``tokens`` rows of ``width`` values (``states`` scale groups per row)."""
    if dtype == FP8:
        return tokens * (width + states)
    return tokens * width * DTYPES[dtype].itemsize


def hidden_bytes_per_token(hidden_size: int, dtype: str) -> int:
    """Stored hidden-state bytes per token: aux ``[3H]`` + final ``[H]`` (8·H in bf16, 4·H + 4 in fp8)."""
    return blob_bytes(dtype, 1, 3 * hidden_size, 3) + blob_bytes(dtype, 1, hidden_size, 1)

HIDDEN_COLUMNS = ("aux_hidden_states", "last_hidden_state")
"""the columns that hold a sample's hidden-state blobs (3 aux states, then the final state), in every table"""

SHARD_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("source", pa.string()),
        ("domain", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("num_tokens", pa.int32()),
        ("aux_hidden_states", pa.binary()),
        ("last_hidden_state", pa.binary()),
        ("source_id", pa.string()),
    ]
)


class Manifest(BaseModel):
    """What a shard folder contains and which target produced it; every consumer checks it before reading."""

    model_config = ConfigDict(extra="allow")

    schema_version: int = SCHEMA_VERSION
    target: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    aux_layer_ids: list[int] = Field(description="physical ids (hidden_states index)")
    dtype: str
    engine: str
    engine_version: str
    num_samples: int = 0
    num_tokens: int = 0
    num_loss_tokens: int = 0
    samples_per_source: dict[str, int] = Field(default_factory=dict)
    quarantined_per_reason: dict[str, int] = Field(default_factory=dict)
    bytes_per_token: float = 0.0

    @property
    def torch_dtype(self) -> torch.dtype:
        """What readers get back (fp8 shards are dequantised to bf16)."""
        return compute_dtype(self.dtype)


def tensor_to_bytes(t: torch.Tensor, dtype: str, states: int = 1) -> bytes:
    """Row-major bytes of ``t`` (``[T, width]``) in the storage dtype (bf16 goes through int16 views: numpy has no
    bf16); fp8 quantises each of the ``states`` equal parts of a row with its own power-of-two scale."""
    if dtype == FP8:
        return bytes(_fp8_buffer(t, states))
    t = t.detach().to("cpu", DTYPES[dtype]).contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().tobytes()
    return t.numpy().tobytes()


def tensor_to_buffer(t: torch.Tensor, dtype: str, states: int = 1) -> bytes | memoryview:
    """The bytes :func:`tensor_to_bytes` gives, without copying them when ``t`` is already a contiguous CPU tensor of
    the storage dtype (a view that keeps ``t`` alive): regen moves ~32 KiB per token of a large target, and every
    pass over them costs. fp8 storage quantises, so it returns new bytes."""
    if dtype == FP8:
        return _fp8_buffer(t, states)
    t = t.detach().to("cpu", DTYPES[dtype]).contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return memoryview(t.numpy()).cast("B")


def bytes_to_tensor(buf: bytes, dtype: str, width: int, states: int = 1) -> torch.Tensor:
    """Inverse of :func:`tensor_to_bytes`: a ``[T, width]`` tensor in :func:`compute_dtype`."""
    if dtype == FP8:
        return dequantize_fp8(*fp8_parts(buf, width, states))
    td = DTYPES[dtype]
    itemsize = torch.empty((), dtype=td).element_size()
    if len(buf) % (itemsize * width):
        raise ValueError(f"corrupt hidden-state blob: {len(buf)} bytes is not a multiple of {itemsize}*{width}")
    raw = torch.frombuffer(bytearray(buf), dtype=torch.int16 if td == torch.bfloat16 else td)
    return raw.view(td).view(-1, width) if td == torch.bfloat16 else raw.view(-1, width)


def _fp8_buffer(t: torch.Tensor, states: int) -> memoryview:
    """fp8 payload then int8 exponents, in one new buffer. The power-of-two scaling is exact in bf16 and fp32 alike,
    so a bf16 tensor is scaled in bf16: regen quantises ~1.2 GB of a 256-sample batch's states after its generation
    (Kimi's widths), and a float32 copy of each row quadrupled the bytes every pass touched. fp16 (narrow exponent)
    goes through float32."""
    import numpy as np

    x = t.detach().to("cpu")
    if x.dtype not in (torch.bfloat16, torch.float32):
        x = x.float()
    rows, width = x.shape
    if width % states:
        raise ValueError(f"width {width} does not split into {states} equal states")
    g = x.reshape(rows, states, width // states)
    amax = torch.maximum(g.amax(dim=-1), -g.amin(dim=-1)).float().clamp_min(1e-30)  # |x| max, no |x| copy
    exp = torch.ceil(torch.log2(amax / FP8_MAX)).clamp(-127, 127)
    out = np.empty(rows * width + rows * states, dtype=np.uint8)
    q = torch.from_numpy(out[:rows * width]).view(torch.float8_e4m3fn).view(rows, states, width // states)
    q.copy_(g * torch.exp2(-exp).to(g.dtype).unsqueeze(-1))
    torch.from_numpy(out[rows * width:]).view(torch.int8).copy_(exp.to(torch.int8).reshape(-1))
    return memoryview(out)


def fp8_parts(buf: bytes, width: int, states: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Split one fp8 blob, undecoded, into its ``[T, width]`` payload (e4m3 bit patterns as uint8) and its
    ``[T, states]`` int8 exponents: what the training data path moves to the device (:func:`dequantize_fp8`)."""
    if width % states:
        raise ValueError(f"width {width} does not split into {states} equal states")
    if len(buf) % (width + states):
        raise ValueError(f"corrupt fp8 hidden-state blob: {len(buf)} bytes is not a multiple of {width}+{states}")
    rows = len(buf) // (width + states)
    raw = torch.frombuffer(bytearray(buf), dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
    return raw[:rows * width].view(rows, width), raw[rows * width:].view(torch.int8).view(rows, states)


def dequantize_fp8(values: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """``values`` (``[..., width]`` e4m3, as uint8 bit patterns or float8_e4m3fn) times ``2**exponents``
    (``[..., states]`` int8, one per equal part of a row), as bf16 on the tensors' own device (CPU or GPU).

    Exact on every device: the scale is built from its IEEE bits rather than by ``exp2``, the product of an e4m3
    value and a power of two is exact in float32, so the only rounding is the final one to bf16 (none for any value
    the writer produces).
    """
    q = values.view(torch.float8_e4m3fn) if values.dtype == torch.uint8 else values
    states = exponents.shape[-1]
    # 2**e for every int8 e as a float64 (exponent field e + 1023: always a normal number), exact in float32 too
    scale = ((exponents.to(torch.int64) + 1023) << 52).view(torch.float64).to(torch.float32)
    x = q.float().unflatten(-1, (states, -1)) * scale.unsqueeze(-1)
    return x.flatten(-2).to(torch.bfloat16)


def write_manifest(out_dir: str | Path, manifest: Manifest) -> Path:
    """Atomically (write + rename) store the manifest."""
    path = Path(out_dir) / "manifest.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest.model_dump(), indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def read_manifest(data_dir: str | Path) -> Manifest:
    """Load ``manifest.json``; a folder without one is not a regen output and is refused with the fix."""
    path = Path(data_dir) / "manifest.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: {data_dir} is not a regen output folder (run `eaglenest regen` first)"
        )
    data: dict[str, Any] = json.loads(path.read_text())
    m = Manifest.model_validate(data)
    if m.schema_version != SCHEMA_VERSION:
        raise ValueError(f"{path}: shard schema_version {m.schema_version}, this eaglenest reads {SCHEMA_VERSION}")
    return m


def shard_files(data_dir: str | Path) -> list[Path]:
    """Completed shard files (temporary files of an interrupted write are ignored)."""
    return sorted(p for p in (Path(data_dir) / "shards").glob("*.parquet") if not p.name.startswith("."))
