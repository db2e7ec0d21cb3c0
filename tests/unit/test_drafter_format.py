"""The export format's readers: one set of sidecar identity keys (old exports keep reading) and one vocab-map check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eaglenest.drafters.eagle3.format import (
    SIDECAR,
    SIDECAR_ID_KEYS,
    DrafterFormatError,
    read_drafter,
    recorded_physical_ids,
    vocab_mapping_problems,
)


@pytest.mark.parametrize("key", SIDECAR_ID_KEYS)
def test_every_sidecar_id_key_is_read(key: str) -> None:
    assert recorded_physical_ids({key: [2, 4, 5]}) == ([2, 4, 5], f"{SIDECAR}:{key}")


def test_sidecar_fallbacks() -> None:
    assert recorded_physical_ids({"drafter_config": {"aux_layer_ids": [3, 6, 9]}})[0] == [3, 6, 9]
    assert recorded_physical_ids({"format": "sglang"}) == (None, "")
    assert recorded_physical_ids(None) == (None, "")


def test_read_drafter_records_unreadable_parts(tmp_path: Path) -> None:
    with pytest.raises(DrafterFormatError, match="does not exist"):
        read_drafter(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"],
                                                      "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}}))
    (tmp_path / SIDECAR).write_text("{not json")
    d = read_drafter(tmp_path)
    assert d.is_eagle3 and d.config_layer_ids == [1, 3, 4] and d.sidecar is None
    assert "not valid JSON" in (d.sidecar_error or "") and "no *.safetensors" in (d.tensor_error or "")
    assert d.trained_layer_ids() == [2, 4, 5]  # no sidecar ids: config.json read in SGLang's convention


def test_vocab_mapping_problems() -> None:
    ids = torch.tensor([0, 2, 5])
    d2t, t2d = ids - torch.arange(3), torch.zeros(8, dtype=torch.bool)
    t2d[ids] = True
    assert vocab_mapping_problems(d2t, t2d) == []
    shifted = t2d.roll(1)
    assert "disagree" in vocab_mapping_problems(d2t, shifted)[0]
    assert "outside the target vocab" in vocab_mapping_problems(d2t + 10, t2d)[0]
    assert "disagree" in vocab_mapping_problems(d2t, t2d & (torch.arange(8) != 5))[0]
