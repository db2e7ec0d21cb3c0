"""The hidden-state shard contract between regen (writer) and drafter (reader).

A regen output folder holds ``shards/*.parquet`` (one row per sample) and ``manifest.json``. Hidden states are
stored as raw row-major bytes (``[T, 3H]`` aux, ``[T, H]`` final normed state) in the manifest's dtype, so storage is
exactly ``8 * H`` bytes per token in bf16 and reading back needs no float parsing.

``source_id`` (the record's own id in its dataset, or ``<file>#<index>``) was added after the first shards were
written: it is the last column, nullable, and readers must not require it (older shards lack it; same
``SCHEMA_VERSION``, since nothing that reads hidden states depends on it).
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

DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

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
        return DTYPES[self.dtype]


def tensor_to_bytes(t: torch.Tensor, dtype: str) -> bytes:
    """Row-major bytes of ``t`` cast to the storage dtype (bf16 goes through int16 views: numpy has no bf16)."""
    t = t.detach().to("cpu", DTYPES[dtype]).contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().tobytes()
    return t.numpy().tobytes()


def bytes_to_tensor(buf: bytes, dtype: str, width: int) -> torch.Tensor:
    """Inverse of :func:`tensor_to_bytes`: a ``[T, width]`` tensor in the storage dtype."""
    td = DTYPES[dtype]
    itemsize = torch.empty((), dtype=td).element_size()
    if len(buf) % (itemsize * width):
        raise ValueError(f"corrupt hidden-state blob: {len(buf)} bytes is not a multiple of {itemsize}*{width}")
    raw = torch.frombuffer(bytearray(buf), dtype=torch.int16 if td == torch.bfloat16 else td)
    return raw.view(td).view(-1, width) if td == torch.bfloat16 else raw.view(-1, width)


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
