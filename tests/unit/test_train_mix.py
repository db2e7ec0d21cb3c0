"""train.mix's row subsampling and train.init_from's shape check, without Ray (the runs themselves: the flywheel's
e2e test trains with both)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from eaglenest.config import ConfigError, load_config
from eaglenest.drafter.data import is_eval_sample, is_kept, split_table
from eaglenest.drafter.init_from import InitDrafter, init_model_config
from eaglenest.drafters.eagle3.config import DrafterModelConfig
from eaglenest.drafters.vocab import VocabMapping

IDS = [f"sample-{i}" for i in range(4000)]


def test_keep_subsamples_deterministically_and_apart_from_the_split() -> None:
    kept = [i for i in IDS if is_kept(i, 0.25, seed=3)]
    assert 850 < len(kept) < 1150
    assert kept == [i for i in IDS if is_kept(i, 0.25, seed=3)]  # same choice on every rerun
    assert all(is_kept(i, 1.0, seed=3) for i in IDS)
    # the mix hash is salted apart from the held-out split: the split keeps its fraction among kept rows
    held = sum(is_eval_sample(i, 0.2, 3) for i in kept) / len(kept)
    assert 0.15 < held < 0.25


def test_split_table_applies_keep_before_the_split() -> None:
    table = pa.table({"id": IDS})
    train = split_table(table, fraction=0.2, seed=0, want_eval=False, keep=0.5).column("id").to_pylist()
    held = split_table(table, fraction=0.2, seed=0, want_eval=True, keep=0.5).column("id").to_pylist()
    assert not set(train) & set(held)
    assert set(train) | set(held) == {i for i in IDS if is_kept(i, 0.5, 0)}


def test_mix_shares_must_leave_room_for_the_data(tmp_path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  mix: [{data: a, share: 1.0}]\n")
    with pytest.raises(ConfigError, match=r"train\.mix\.0\.share"):
        load_config(f)


def _cfg(**kw) -> DrafterModelConfig:
    base = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256,
                vocab_size=1024, draft_vocab_size=256, aux_layer_ids=[2, 4, 5], target_hidden_size=128,
                target_num_layers=8, target="/old/target")
    return DrafterModelConfig(**{**base, **kw})


def test_init_from_keeps_the_drafters_shape_over_this_target() -> None:
    mapping = VocabMapping(torch.arange(256), 1024, torch.zeros(1024, dtype=torch.long))
    init = InitDrafter(Path("/live"), _cfg(intermediate_size=512), mapping)
    got = init_model_config(init, _cfg(target="/new/target", target_architecture="LlamaForCausalLM"))
    assert got.intermediate_size == 512 and got.target == "/new/target"
    assert got.target_architecture == "LlamaForCausalLM"
    assert dataclasses.replace(got, target="/old/target", target_architecture="") == init.config


@pytest.mark.parametrize("change", [{"aux_layer_ids": [1, 4, 5]}, {"vocab_size": 2048, "draft_vocab_size": 256},
                                    {"target_num_layers": 12}])
def test_init_from_refuses_a_drafter_of_another_target(change) -> None:
    init = InitDrafter(Path("/live"), _cfg(), VocabMapping(torch.arange(256), 1024, torch.zeros(1024)))
    with pytest.raises(ValueError, match="does not fit this run's target and shards .* unset train.init_from"):
        init_model_config(init, _cfg(**change))
