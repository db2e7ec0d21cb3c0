"""The SGLang backend's own logic without sglang or a GPU: launch args, preflight, parsing, batching, imports."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eaglenest.config import SGLangEngineConfig, SpecConfig, TargetConfig
from eaglenest.contracts.layers import default_aux_layer_ids, engine_captured_layers, engine_layer_ids
from eaglenest.contracts.target import TargetSpec
from eaglenest.drafters.eagle3.format import read_drafter
from eaglenest.drafters.preflight import SpeculativeConfigError, derive_algorithm
from eaglenest.engines.base import SamplingParams, decode_texts
from eaglenest.engines.sglang.args import (
    SGLANG_VERSION,
    SGLangOutputError,
    SGLangVersionError,
    capture_server_kwargs,
    check_sglang_version,
    engine_kwargs,
    generation_from_output,
    map_finish_reason,
    per_request_sampling,
    plan_capture_batches,
    reorder_aux,
    run_generate,
    spec_meta,
)
from eaglenest.engines.sglang.spec import speculative_engine_kwargs, speculative_launch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: sglang_shims
from sglang_shims.fixtures import export_eagle3_drafter, write_eagle3_drafter, write_target  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PHYS = default_aux_layer_ids(8)  # [2, 4, 5]


# ---------------------------------------------------------------------------------------------------- version / args
def test_version_check() -> None:
    check_sglang_version(SGLANG_VERSION)
    with pytest.raises(SGLangVersionError, match="pinned to 0.5.14"):
        check_sglang_version("0.5.23")
    with pytest.raises(SGLangVersionError, match="not installed"):
        check_sglang_version(None)


def test_engine_kwargs_prefix_cache_on_and_backends() -> None:
    cfg = SGLangEngineConfig(max_running_requests=64, extra_args={"cuda_graph_max_bs_decode": 16})
    kw = engine_kwargs("/m", cfg, dtype="bfloat16", seed=7)
    assert kw["disable_radix_cache"] is False
    assert (kw["attention_backend"], kw["sampling_backend"], kw["grammar_backend"]) == ("triton", "pytorch", "none")
    assert kw["random_seed"] == 7 and kw["max_running_requests"] == 64 and kw["cuda_graph_max_bs_decode"] == 16
    assert "context_length" not in kw and not any(k.startswith("speculative") for k in kw)
    with pytest.raises(ValueError, match="may not set"):
        engine_kwargs("/m", SGLangEngineConfig(extra_args={"speculative_algorithm": "EAGLE"}))


def test_capture_kwargs_turn_off_radix_and_chunking() -> None:
    kw = capture_server_kwargs("/m", SGLangEngineConfig(), max_total_tokens=4096)
    assert kw["disable_radix_cache"] is True and kw["chunked_prefill_size"] == -1
    assert kw["disable_cuda_graph"] is True and kw["tp_size"] == 1 and kw["max_total_tokens"] == 4096
    with pytest.raises(ValueError, match="tp_size is 2"):
        capture_server_kwargs("/m", SGLangEngineConfig(tp_size=2))


def test_sampling_params() -> None:
    greedy = per_request_sampling(SamplingParams(max_new_tokens=9, stop=("\n\n",)), 2, stop_token_ids=(5, 2))
    assert greedy[0] == {"max_new_tokens": 9, "temperature": 0.0, "top_p": 1.0, "skip_special_tokens": True,
                         "top_k": 1, "stop": ["\n\n"], "stop_token_ids": [2, 5]}
    sampled = per_request_sampling(SamplingParams(temperature=0.7, top_p=0.9, seed=3), 3)
    seeds = [s["sampling_seed"] for s in sampled]
    assert len(set(seeds)) == 3 and "top_k" not in sampled[0]
    assert "sampling_seed" not in per_request_sampling(SamplingParams(temperature=0.7), 1)[0]
    fixed = per_request_sampling(SamplingParams(max_new_tokens=9, ignore_eos=True), 1, stop_token_ids=(2,))[0]
    assert fixed["ignore_eos"] is True and "stop_token_ids" not in fixed
    ext = per_request_sampling(SamplingParams(temperature=0.7, top_k=20, min_p=0.05, repetition_penalty=1.1), 1)[0]
    assert (ext["top_k"], ext["min_p"], ext["repetition_penalty"]) == (20, 0.05, 1.1)
    assert per_request_sampling(SamplingParams(top_k=20), 1)[0]["top_k"] == 1  # greedy stays greedy


def test_logprob_arguments_and_output_parsing() -> None:
    from eaglenest.engines.sglang.args import logprob_kwargs, output_logprobs

    assert logprob_kwargs(SamplingParams()) == {}
    assert logprob_kwargs(SamplingParams(logprobs=3)) == {"return_logprob": True, "top_logprobs_num": 3,
                                                          "logprob_start_len": -1}
    meta = {"output_token_logprobs": [[-0.5, 7, None], [-1.5, 9, None]],
            "output_top_logprobs": [[[-0.5, 7, None], [-2.0, 3, None]], None]}
    assert output_logprobs(meta, 0, 3) == [(7, -0.5, [(7, -0.5), (3, -2.0)]), (9, -1.5, [])]
    assert output_logprobs(meta, 1, 2) == [(9, -1.5, [])] and output_logprobs({}, 0, 2) == []


# ------------------------------------------------------------------------------------------------- output parsing
def test_finish_reason_mapping() -> None:
    assert map_finish_reason({"type": "stop", "matched": 2}) == "stop"
    assert map_finish_reason({"type": "length", "length": 8}) == "length"
    with pytest.raises(SGLangOutputError, match="aborted"):
        map_finish_reason({"type": "abort", "message": "too long"})
    with pytest.raises(SGLangOutputError, match="unknown finish_reason"):
        map_finish_reason(None)


def _out(ids, finish, **meta):
    return {"text": "ignored", "output_ids": ids, "meta_info": {"finish_reason": finish, "prompt_tokens": 4, **meta}}


def test_generation_keeps_eos_and_cuts_stop_strings() -> None:
    def decode(t):
        return " ".join(str(i) for i in t)

    g = generation_from_output(_out([7, 8, 2], {"type": "stop", "matched": 2}), prompt_len=4, decode=decode)
    assert g.token_ids == [7, 8, 2] and g.finish_reason == "stop" and g.prompt_tokens == 4
    g = generation_from_output(_out([7, 8], {"type": "stop", "matched": 2}), prompt_len=4, decode=decode)
    assert g.token_ids == [7, 8, 2]  # a trimmed end-of-turn token is put back
    g = generation_from_output(_out([7, 8, 9], {"type": "length", "length": 3}), prompt_len=4, decode=decode,
                               stop=(" 8",))
    assert (g.text, g.finish_reason, g.token_ids) == ("7", "stop", [7, 8, 9])
    with pytest.raises(SGLangOutputError, match="output_ids"):
        generation_from_output({"meta_info": {"finish_reason": {"type": "stop"}}}, prompt_len=1, decode=decode)


def test_spec_meta_accept_length() -> None:
    assert spec_meta({"completion_tokens": 10}) == {}
    m = spec_meta({"completion_tokens": 12, "spec_verify_ct": 4, "spec_accept_length": 3.0,
                   "spec_num_correct_drafts": 8, "spec_num_proposed_drafts": 12})
    assert m["accept_length"] == 3.0 and m["draft_tokens_accepted"] == 8 and m["draft_tokens_proposed"] == 12
    old = spec_meta({"completion_tokens": 5, "spec_verify_ct": 5, "spec_accept_token_num": 0})  # 0.5.10 field names
    assert old["accept_length"] == 1.0 and old["draft_tokens_accepted"] == 0


def test_run_generate_submits_the_whole_batch_once() -> None:
    calls = []

    def generate(*, input_ids, sampling_params):
        calls.append((input_ids, sampling_params))
        return [_out([p[-1] + 1, 2], {"type": "stop", "matched": 2}, completion_tokens=2, spec_verify_ct=1)
                for p in input_ids]

    prompts = [[1, 5, 9], [1, 6], [1, 7, 7, 7]]
    gens = run_generate(generate, prompts, SamplingParams(max_new_tokens=4), decode=str, vocab_size=100,
                        eos_token_ids=(2,))
    assert len(calls) == 1 and calls[0][0] == prompts and len(calls[0][1]) == 3
    assert [g.token_ids for g in gens] == [[10, 2], [7, 2], [8, 2]]
    assert gens[0].meta["accept_length"] == 2.0
    # the batch's texts in one call: each output's ids (the end-of-turn token put back) decoded once, in order
    batched: list[list[list[int]]] = []
    gens2 = run_generate(generate, prompts, SamplingParams(max_new_tokens=4), decode=str, vocab_size=100,
                         eos_token_ids=(2,), decode_many=lambda seqs: batched.append(seqs) or [f"t{s}" for s in seqs])
    assert batched == [[[10, 2], [7, 2], [8, 2]]]
    assert [g.text for g in gens2] == ["t[10, 2]", "t[7, 2]", "t[8, 2]"]
    assert [g.token_ids for g in gens2] == [g.token_ids for g in gens]
    with pytest.raises(ValueError, match="outside the vocab"):
        run_generate(generate, [[1, 500]], SamplingParams(), decode=str, vocab_size=100)
    with pytest.raises(ValueError, match="empty"):
        run_generate(generate, [[]], SamplingParams(), decode=str)
    with pytest.raises(SGLangOutputError, match="2 outputs for 1"):
        run_generate(lambda **k: [_out([3], {"type": "length"})] * 2, [[1]], SamplingParams(), decode=str)


def test_capture_batch_plan_and_aux_order() -> None:
    assert plan_capture_batches([5, 5, 5, 12, 1], 12) == [[0, 1], [2], [3], [4]]
    assert plan_capture_batches([1] * 5, 100, max_seqs=2) == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="capture_max_tokens"):
        plan_capture_batches([13], 12)
    assert reorder_aux([2, 4, 5], [5, 2, 4]) == [2, 0, 1]
    with pytest.raises(ValueError, match="not captured"):
        reorder_aux([2, 4, 5], [3, 4, 5])


# ------------------------------------------------------------------------------------------------------ preflight
@pytest.fixture
def target(tmp_path: Path) -> Path:
    return write_target(tmp_path / "target")


def test_speculative_kwargs_from_a_checked_drafter(tmp_path: Path, target: Path) -> None:
    drafter = export_eagle3_drafter(tmp_path / "d", physical_ids=PHYS)  # eaglenest's own exporter
    kw, launch = speculative_engine_kwargs(str(target), SGLangEngineConfig(), drafter, SpecConfig())
    assert kw["speculative_algorithm"] == "EAGLE3"
    assert (kw["speculative_num_steps"], kw["speculative_eagle_topk"], kw["speculative_num_draft_tokens"]) == (3, 1, 4)
    assert launch.captured_layers == tuple(PHYS)
    assert kw["disable_radix_cache"] is False


@pytest.mark.parametrize(("hidden", "attention", "asked", "expected"), [
    (448, "flashinfer", None, "triton"),  # 4 heads of 112: Kimi's Llama-shaped head (64 x 112) in small
    (448, "triton", None, None),  # triton runs any head size: nothing to override
    (512, "flashinfer", None, None),  # control: 128 is one of flashinfer's sizes
    (448, "flashinfer", "triton", "triton"),  # asked for what works: kept
])
def test_a_draft_head_size_flashinfer_lacks_drafts_on_triton(tmp_path: Path, hidden: int, attention: str,
                                                             asked: str | None, expected: str | None) -> None:
    target = write_target(tmp_path / "t", hidden=hidden, heads=4)
    drafter = export_eagle3_drafter(tmp_path / "d", physical_ids=PHYS, hidden=hidden, heads=4)
    extra = {"speculative_draft_attention_backend": asked} if asked else {}
    kw, _ = speculative_engine_kwargs(str(target), SGLangEngineConfig(attention_backend=attention, extra_args=extra),
                                      drafter, SpecConfig())
    assert kw.get("speculative_draft_attention_backend") == expected
    assert kw["attention_backend"] == attention  # the target keeps its backend


def test_flashinfer_asked_for_a_draft_head_size_it_lacks_is_refused_with_the_fix(tmp_path: Path) -> None:
    target = write_target(tmp_path / "t", hidden=448, heads=4)
    drafter = export_eagle3_drafter(tmp_path / "d", physical_ids=PHYS, hidden=448, heads=4)
    cfg = SGLangEngineConfig(attention_backend="flashinfer",
                             extra_args={"speculative_draft_attention_backend": "flashinfer"})
    with pytest.raises(SpeculativeConfigError, match="head_dim 112.*speculative_draft_attention_backend to triton"):
        speculative_engine_kwargs(str(target), cfg, drafter, SpecConfig())


def test_eagle_refused_for_an_eagle3_drafter(tmp_path: Path, target: Path) -> None:
    drafter = write_eagle3_drafter(tmp_path / "d", physical_ids=PHYS)
    with pytest.raises(SpeculativeConfigError, match="accept length would sit at 1.0"):
        speculative_engine_kwargs(str(target), SGLangEngineConfig(), drafter, SpecConfig(algorithm="EAGLE"))
    assert derive_algorithm(read_drafter(drafter), None) == "EAGLE3"
    plain = write_eagle3_drafter(tmp_path / "p", physical_ids=PHYS, architecture="LlamaForCausalLMEagle")
    with pytest.raises(SpeculativeConfigError, match="not a drafter eaglenest serves"):
        derive_algorithm(read_drafter(plain))


def test_layer_ids_checked_with_the_engine_rule(tmp_path: Path, target: Path) -> None:
    # physical ids written as-is (the lightseekorg style): a Llama target would capture [3, 5, 6], not [2, 4, 5]
    wrong = write_eagle3_drafter(tmp_path / "w", physical_ids=PHYS, config_ids=PHYS)
    with pytest.raises(SpeculativeConfigError, match=r"capture physical layers \[3, 5, 6\].*write "
                                                     r"eagle_aux_hidden_state_layer_ids: \[1, 3, 4\]"):
        speculative_engine_kwargs(str(target), SGLangEngineConfig(), wrong, SpecConfig())
    # the same list is right for a DeepSeek/Kimi target in sglang 0.5.14 (+1 only when the first id is 1)
    ds = TargetSpec(num_layers=8, hidden_size=128, vocab_size=1024, architecture="DeepseekV3ForCausalLM",
                    context_length=2048)
    assert speculative_launch(read_drafter(wrong), ds, SpecConfig()).captured_layers == tuple(PHYS)
    assert engine_layer_ids([2, 30, 58], engine="sglang", architecture="LlamaForCausalLM",
                            num_layers=61) == [1, 29, 57]
    for arch in ("LlamaForCausalLM", "DeepseekV3ForCausalLM"):
        for phys in ([2, 30, 58], [3, 30, 58], [1, 4, 6]):
            if arch.startswith("Deepseek") and phys[0] == 1:  # sglang 0.5.14 cannot tap physical layer 1 there
                with pytest.raises(ValueError, match="no eagle_aux_hidden_state_layer_ids"):
                    engine_layer_ids(phys, engine="sglang", architecture=arch, num_layers=61)
                continue
            ids = engine_layer_ids(phys, engine="sglang", architecture=arch, num_layers=61)
            assert engine_captured_layers(ids, engine="sglang", architecture=arch, num_layers=61) == phys


def test_unknown_physical_ids_refused_unless_given(tmp_path: Path, target: Path) -> None:
    d = write_eagle3_drafter(tmp_path / "d", physical_ids=PHYS, sidecar=False)
    with pytest.raises(SpeculativeConfigError, match="unknown"):
        speculative_engine_kwargs(str(target), SGLangEngineConfig(), d, SpecConfig())
    kw, _ = speculative_engine_kwargs(str(target), SGLangEngineConfig(), d, SpecConfig(), expected_physical_ids=PHYS)
    assert kw["speculative_algorithm"] == "EAGLE3"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"fc_in": 256}, "fc.weight takes 256 inputs"),
    ({"drop_weights": ["midlayer.mlp.down_proj.weight"]}, "weights missing"),
    ({"extra_config": {"num_hidden_layers": 2}}, "num_hidden_layers is 2"),
    ({"extra_config": {"num_nextn_predict_layers": 0}}, "num_nextn_predict_layers"),
    ({"context": 1024}, "max_position_embeddings 1024"),
    ({"hidden": 64, "fc_in": 384}, "target hidden size 64"),
    ({"config_ids": [1, 3, 9]}, "out of range"),
])
def test_preflight_refusals(tmp_path: Path, target: Path, kwargs: dict, message: str) -> None:
    d = write_eagle3_drafter(tmp_path / "d", physical_ids=PHYS, **kwargs)
    with pytest.raises(SpeculativeConfigError, match=message):
        speculative_engine_kwargs(str(target), SGLangEngineConfig(), d, SpecConfig())


def test_target_facts_read_multimodal_text_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["KimiK25ForConditionalGeneration"],
        "text_config": {"num_hidden_layers": 61, "hidden_size": 7168, "vocab_size": 163840,
                        "max_position_embeddings": 262144}}))
    facts = TargetSpec.read(tmp_path)
    assert (facts.num_layers, facts.hidden_size, facts.context_length, facts.first_id_rule) == (61, 7168, 262144, True)


# ------------------------------------------------------------------------------------------------ lazy sglang import
def test_nothing_imports_sglang() -> None:
    # the packages, our backend modules, and the modules that name the sglang backend (imported lazily there);
    # every other file is covered by the static check below
    code = (
        "import sys, eaglenest, eaglenest.engines, eaglenest.engines.sglang.engine, eaglenest.engines.sglang.args, "
        "eaglenest.engines.sglang.spec, eaglenest.engines.sglang.capture, eaglenest.engines.sglang.symbols, "
        "eaglenest.regen, eaglenest.drafter, eaglenest.serve, eaglenest.serve.backends, "
        "eaglenest.drafters.preflight\n"
        "bad = sorted(k for k in sys.modules if k == 'sglang' or k.startswith('sglang.'))\n"
        "assert not bad, bad\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_sglang_only_reached_through_the_listed_internals() -> None:
    """No module of the repo has an ``import sglang`` statement; the backend goes through ``sglang_symbol``."""
    offenders = []
    for pkg in ("eaglenest",):
        for f in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                if any(n == "sglang" or n.startswith("sglang.") for n in names):
                    offenders.append(f"{f.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders
    from eaglenest.engines.sglang.engine import sglang_symbol

    with pytest.raises(KeyError, match="SGLANG_INTERNALS"):
        sglang_symbol("sglang.srt.managers.scheduler:Scheduler")


def test_engine_without_sglang_fails_with_the_fix() -> None:
    from eaglenest.engines import load_engine

    with pytest.raises(SGLangVersionError, match="pip install 'eaglenest\\[gpu\\]'"):
        load_engine(TargetConfig(engine="sglang"))


def test_target_facts_and_weights_match_the_hf_backend(tiny_target_path: Path, tiny_engine) -> None:
    """What the sglang engine reports about a target (read from its folder) equals what the hf backend loads."""
    import torch
    from transformers import AutoTokenizer

    from eaglenest.engines.sglang.engine import target_info

    path = str(tiny_target_path)
    spec = TargetSpec.read(path)
    info = target_info(spec, AutoTokenizer.from_pretrained(path), "bfloat16")
    ref = tiny_engine.info
    assert (info.num_layers, info.hidden_size, info.vocab_size, info.architecture, info.eos_token_ids) == (
        ref.num_layers, ref.hidden_size, ref.vocab_size, ref.architecture, ref.eos_token_ids)
    assert info.engine == "sglang" and info.max_position_embeddings == ref.max_position_embeddings
    embed, head = spec.load_embed_and_head()
    assert torch.equal(head, tiny_engine.lm_head_weight().detach().cpu())
    assert torch.equal(embed, tiny_engine.embed_weight().detach().cpu())
    assert spec.embed_shape() == list(embed.shape) and spec.lm_head_shape() == list(head.shape)
    with pytest.raises(KeyError, match="not_a_tensor"):
        spec.load_tensor("not_a_tensor")


@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_batched_decoding_gives_the_texts_of_one_by_one_decoding(tiny_engine, skip_special_tokens: bool) -> None:
    """``decode_texts`` goes straight to the fast tokenizer's backend; it must give what ``decode`` gives, special
    tokens and odd byte sequences included, and fall back to ``decode`` where a clean-up pass would change the text."""
    tok = tiny_engine.tokenizer
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, len(tok), (n,), generator=g).tolist() for n in (0, 1, 7, 40, 160)]
    seqs.append(list(tiny_engine.info.eos_token_ids) + seqs[3] + list(tiny_engine.info.eos_token_ids))
    for clean_up in (None, False):
        want = [tok.decode(s, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=clean_up)
                for s in seqs]
        assert decode_texts(tok, seqs, skip_special_tokens=skip_special_tokens,
                            clean_up_tokenization_spaces=clean_up) == want
    text = "Hello , world ! it 's"
    ids = tok.encode(text, add_special_tokens=False)
    cleaned = tok.decode(ids, clean_up_tokenization_spaces=True)
    assert decode_texts(tok, [ids], skip_special_tokens=False, clean_up_tokenization_spaces=True) == [cleaned]


def test_regen_warm_up_requests_are_distinct_greedy_and_decode_every_step(tiny_target_path: Path) -> None:
    from transformers import AutoTokenizer

    from eaglenest.engines.sglang.warmup import warmup_requests

    tok = AutoTokenizer.from_pretrained(str(tiny_target_path))
    prompts, sampling = warmup_requests(tok, 8, 32)
    assert len(prompts) == 8 and len({tuple(p) for p in prompts}) == 8
    assert all(5 <= len(p) <= 128 and max(p) < len(tok) for p in prompts)
    assert sampling["temperature"] == 0.0 and sampling["top_k"] == 1
    assert sampling["max_new_tokens"] == 32 and sampling["ignore_eos"] is True  # no request ends early
    assert warmup_requests(tok, 0, 32)[0] == []
    assert SGLangEngineConfig().warmup_prompts == 64 and SGLangEngineConfig(warmup_prompts=0).warmup_prompts == 0
