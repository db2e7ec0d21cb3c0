"""How to launch an exported EAGLE-3 drafter in each engine: the README written next to the weights, and the lines
``eaglenest export`` prints.

Each engine has one setting that, when wrong, gives no error and no speedup, or a crash long after the launch: SGLang
needs ``--speculative-algorithm EAGLE3`` exactly (``EAGLE`` feeds the drafter the final hidden state: accept length
1.0); vLLM needs ``"method": "eagle3"`` in ``speculative_config`` (without it the folder is loaded as a plain draft
model and the engine dies at the first decode, unless the path happens to contain "eagle3"). The README says so next to
the weights, with the exact settings, so a user who never runs eaglenest's preflight still sees them.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from eaglenest.drafters.eagle3.config import LAUNCH_NUM_STEPS, DrafterModelConfig
from eaglenest.drafters.eagle3.engine_ids import FORMAT_ENGINES, IDS_KEY, WRITTEN
from eaglenest.drafters.registry import EAGLE3
from eaglenest.targets import arch_for

VLLM_VERSION = "0.32.0"
"""the vLLM release CI's contract step loads eaglenest's export with (.ci/vllm_contract.sh)"""
SGLANG_VERSION = "0.5.14"


def vllm_speculative_config(drafter: str | Path, num_speculative_tokens: int = LAUNCH_NUM_STEPS
                             ) -> dict[str, Any]:
    """vLLM's ``speculative_config`` for an eaglenest EAGLE-3 export (``method`` is not optional)."""
    return {"method": EAGLE3.vllm_method, "model": str(drafter), "num_speculative_tokens": int(num_speculative_tokens)}


def sglang_flags(drafter: str | Path, num_steps: int = LAUNCH_NUM_STEPS, topk: int = 1,
                 num_draft_tokens: int = LAUNCH_NUM_STEPS + 1) -> list[str]:
    """``sglang.launch_server`` flags for an eaglenest EAGLE-3 export (the algorithm is derived, never ``EAGLE``)."""
    return ["--speculative-algorithm", EAGLE3.sglang_algorithm, "--speculative-draft-model-path", str(drafter),
            "--speculative-num-steps", str(num_steps), "--speculative-eagle-topk", str(topk),
            "--speculative-num-draft-tokens", str(num_draft_tokens)]


def full_vocab_problem(cfg: DrafterModelConfig) -> str | None:
    """vLLM 0.32 allocates no ``d2t`` for a drafter whose draft vocab is the whole target vocab, then refuses the
    ``d2t`` tensor every eaglenest export carries ("There is no module or parameter named 'draft_id_to_target_id'")."""
    if cfg.draft_vocab_size != cfg.vocab_size:
        return None
    return (f"vLLM {VLLM_VERSION} refuses to load this folder: its draft vocab is the whole target vocab "
            f"({cfg.vocab_size}), for which vLLM has no d2t parameter; train with a smaller draft vocab "
            f"(train.drafter.draft_vocab_size < {cfg.vocab_size})")


def _ids(cfg: DrafterModelConfig, fmt: str, engine: str, ids_for: dict[str, list[int]]) -> str:
    places = [("the top-level " if place == "top" else "eagle_config.") + IDS_KEY
              for place, e in WRITTEN[fmt].items() if e == engine]
    reads = {"sglang": f"eagle_config.{IDS_KEY}", "vllm": f"the top-level {IDS_KEY}"}[engine]
    return f"reads {reads} = {ids_for[engine]}" if places else f"reads {reads}"


def serving_readme(cfg: DrafterModelConfig, fmt: str, folder: str | Path, ids_for: dict[str, list[int]]) -> str:
    """The README.md of an export folder: what it is, and the launch settings of each engine it is written for
    (``ids_for``: the ids written for each engine, ``format.engine_config_ids``)."""
    engines = FORMAT_ENGINES[fmt]
    target = cfg.target or "<the target model folder>"
    arch = cfg.target_architecture or "Llama-style"
    rule = ("+1 only when the first id is 1" if arch_for(cfg.target_architecture).sglang_rule == "first_id"
            else "+1 to every id")
    d = str(folder)
    lines = [
        f"# EAGLE-3 drafter for {target}",
        "",
        f"Exported by eaglenest (format `{fmt}`). Trained on the target's physical layers {list(cfg.aux_layer_ids)} "
        f"(indexes into transformers' `hidden_states`; {cfg.target_num_layers}-layer {arch} "
        "target). `eaglenest_drafter.json` records them; the engines never read that file, only `config.json`.",
        "",
        f"Check a launch before serving: `eaglenest preflight --target {target} --drafter {d} --engine "
        f"{'|'.join(engines)}`.",
        "",
    ]
    spec = json.dumps(vllm_speculative_config(d))
    lines += ["## vLLM", ""]
    if "vllm" in engines:
        lines += [
            f"vLLM {_ids(cfg, fmt, 'vllm', ids_for)} as physical ids (both of its model runners read that key).",
            "",
            "```python",
            "from vllm import LLM",
            f"llm = LLM(model={target!r}, speculative_config={spec})",
            "```",
            "",
            "```bash",
            f"vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(spec)}",
            "```",
            "",
            '`"method": "eagle3"` is required: without it vLLM loads this folder as a plain draft model (unless its '
            "path contains \"eagle3\") and the engine dies at the first decode (`Eagle3LlamaForCausalLM.forward() "
            "missing ... 'hidden_states'`); `\"method\": \"eagle\"` is refused.",
        ]
        problem = full_vocab_problem(cfg)
        if problem:
            lines += ["", f"**Warning:** {problem}."]
    else:
        lines += [f"Not for vLLM: this folder carries only SGLang's ids ({ids_for.get('sglang')} in eagle_config), "
                  "which vLLM takes as physical ids: it would capture the wrong layers and accept far fewer draft "
                  "tokens, without an error. Export again without `--format sglang` (the default loads in both)."]
    lines += ["", "## SGLang", ""]
    if "sglang" in engines:
        lines += [
            f"SGLang {SGLANG_VERSION} {_ids(cfg, fmt, 'sglang', ids_for)} and applies its rule for this target "
            f"({rule}), which gives the physical layers above.",
            "",
            "```bash",
            f"python -m sglang.launch_server --model-path {shlex.quote(target)} "
            + " ".join(shlex.quote(x) for x in sglang_flags(d)),
            "```",
            "",
            "`EAGLE3` exactly: under `EAGLE` SGLang feeds the drafter the final hidden state instead of the three "
            "aux layers, skips its fc and accept length sits at 1.0, with no error.",
        ]
    else:
        lines += [f"Not for SGLang: this folder carries physical ids ({ids_for.get('vllm')}) where SGLang reads its "
                  f"own convention; SGLang would capture the wrong layers. Export again without `--format vllm`."]
    lines += ["", "Do not convert this folder with `speculators convert` without passing the layer ids again "
              "(`--algorithm-kwargs '{\"eagle_aux_hidden_state_layer_ids\": [...]}'`): speculators 0.9.0 writes them "
              "as null and vLLM then falls back to its default taps.", ""]
    return "\n".join(lines)


def export_summary(cfg: DrafterModelConfig, fmt: str, folder: str | Path) -> str:
    """What ``eaglenest export`` prints: the launch settings of each engine the folder is written for."""
    d = str(folder)
    out = []
    if "vllm" in FORMAT_ENGINES[fmt]:
        out.append(f"  vLLM:   speculative_config={json.dumps(vllm_speculative_config(d))}")
        problem = full_vocab_problem(cfg)
        if problem:
            out.append(f"          warning: {problem}")
    if "sglang" in FORMAT_ENGINES[fmt]:
        out.append("  SGLang: " + " ".join(shlex.quote(x) for x in sglang_flags(d)))
    out.append(f"  (README.md in {d} has the details)")
    return "\n".join(out)
