"""Capture during generation under tensor parallelism, on CPUs: one rank records.

Under TP every rank of an SGLang engine runs the same forward and, after the all-reduce, holds the same residual
stream, and SGLang attaches the ``forward_hooks`` in every rank's scheduler process. Only rank 0 may write rows: two
ranks recording into one sink would write each forward twice. Here two processes form a real ``torch.distributed``
group (gloo on 127.0.0.1), each runs the DeepseekV2-convention CPU model of ``tests/capture_toy.py`` with the hooks
attached as SGLang attaches them, and the engine actor's side (the recorder and its sink, in this process) assembles
what they wrote. Each rank reports the forwards its hooks recorded: rank 0 all of them, rank 1 none (control: a rank
that skips the selection writes chunks as well, which the test would see). Which tensor SGLang's DeepseekV2 leaves
replicated under TP > 1 is measured on GPUs (the multi-GPU issue).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from capture_toy import AUX, H, Model, Scheduler, V, attach

from eaglenest.engines.base import CaptureHint
from eaglenest.engines.sglang.recorded import GenerationRecorder

ARCH = "DeepseekV3ForCausalLM"


def _rank_main(rank: int, world: int, port: int, specs: list[dict], prompts: list[list[int]], max_new: list[int],
               rids: list[str], both_record: bool, out: str) -> None:
    """One TP rank: join the group, attach the hooks as SGLang does, generate; rank 0 saves what it generated."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        if both_record:  # the control: a rank that ignores the selection
            from eaglenest.engines.sglang import hooks

            hooks._is_primary_rank = lambda: True
        model = Model("deepseek")
        attach(model, specs)
        gens = Scheduler(model).generate(prompts, max_new, rids)
        from eaglenest.engines.sglang.hooks import _RECORDERS

        for rec in _RECORDERS.values():
            rec.close()
        recorded = sum(rec.seq for rec in _RECORDERS.values())  # forwards this rank's hooks wrote out
        dist.barrier()
        torch.save({"recorded": recorded, "gens": [(g.token_ids, g.meta) for g in gens]}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _record_with_two_ranks(tmp_path: Path, both_record: bool):
    rec = GenerationRecorder(str(tmp_path / "sink"), AUX, hidden_size=H, dtype="float32", writers=1,
                             architecture=ARCH)
    rec.sink.start()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, V, (n,), generator=g).tolist() for n in (7, 4, 10)]
    max_new = [3, 5, 2]
    rids = rec.new_rids(len(prompts))
    out = tmp_path / "gens.pt"
    mp.spawn(_rank_main, args=(2, _free_port(), rec.hooks, prompts, max_new, rids, both_record, str(out)),
             nprocs=2, join=True)
    from eaglenest.engines.base import Generation

    ranks = [torch.load(f"{out}.{r}") for r in range(2)]
    assert ranks[0]["gens"] == ranks[1]["gens"]  # the ranks ran the same forwards
    gens = [Generation(token_ids=t, text="", finish_reason="length", prompt_tokens=len(p), meta=m)
            for (t, m), p in zip(ranks[0]["gens"], prompts, strict=True)]
    rec.expect(rids, prompts, gens)
    seqs = [p + gen.token_ids for p, gen in zip(prompts, gens, strict=True)]
    masks = [[0] * len(p) + [1] * len(gen.token_ids) for p, gen in zip(prompts, gens, strict=True)]
    hints = [CaptureHint(gen.meta["capture_ref"], m) for gen, m in zip(gens, masks, strict=True)]
    return rec, seqs, hints, [r["recorded"] for r in ranks]


def test_rank_zero_records_and_the_states_are_the_forward(tmp_path) -> None:
    rec, seqs, hints, recorded = _record_with_two_ranks(tmp_path, both_record=False)
    assert recorded[0] > 0 and recorded[1] == 0
    caps = rec.capture(seqs, hints, prefill=lambda s, r: (_ for _ in ()).throw(AssertionError("all recorded")))
    assert rec.counts == {"generation": 3}
    model = Model("deepseek")
    for seq, cap in zip(seqs, caps, strict=True):
        got = torch.cat([cap.aux_hidden_states, cap.last_hidden_state], dim=-1)[:-1]
        torch.testing.assert_close(got, model.model.reference(seq)[:-1], rtol=1e-6, atol=1e-6)
    rec.close()


def test_a_rank_that_skips_the_selection_records_every_forward_again(tmp_path) -> None:
    """The control: rank 1 then writes chunks too (into the same sink, under the same names as rank 0's: the two
    collide), which the first test's ``recorded[1] == 0`` would catch."""
    rec, _, _, recorded = _record_with_two_ranks(tmp_path, both_record=True)
    assert recorded[1] > 0
    rec.close()
