"""The embedded tiny target: deterministic, an ordinary HF folder, with a chat template that covers every role."""

from __future__ import annotations

import hashlib
import subprocess
import sys

from eaglenest.config import TinyTargetSpec


def _digest(folder) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def test_cli_rebuild_is_bit_identical(tmp_path, tiny_target_path):
    """A second build (through the CLI, in a fresh process) reproduces the cached folder byte for byte."""
    from eaglenest.engines.tiny import spec_key

    assert tiny_target_path.name.endswith(spec_key(TinyTargetSpec()))
    out = tmp_path / "cli"
    proc = subprocess.run([sys.executable, "-m", "eaglenest.cli", "tiny-target", str(out)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert _digest(out) == _digest(tiny_target_path)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(_digest(out))


def test_loads_with_plain_transformers(tiny_target_path):
    code = (
        "import sys; from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(tiny_target_path)!r})\n"
        f"t = AutoTokenizer.from_pretrained({str(tiny_target_path)!r})\n"
        "assert m.config.architectures == ['LlamaForCausalLM'] and m.config.num_hidden_layers >= 8\n"
        "msgs=[{'role':'system','content':'s'},{'role':'user','content':'u'},"
        "{'role':'assistant','content':'a','reasoning_content':'r','tool_calls':[{'type':'function','function':"
        "{'name':'f','arguments':{'x':1}}}]},{'role':'tool','content':'{}'}]\n"
        "s = t.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)\n"
        "assert '<think>r</think>' in s and '<tool_call>' in s and '<|tool|>' in s and s.endswith('<|assistant|>'), s\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


def test_chat_template_is_append_only(tiny_engine):
    from eaglenest.engines import render_chat_text

    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello", "reasoning_content": "greet"},
            {"role": "user", "content": "bye"}]
    tok = tiny_engine.tokenizer
    for k in range(1, len(msgs)):
        short = render_chat_text(tok, msgs[:k], add_generation_prompt=False)
        longer = render_chat_text(tok, msgs[: k + 1], add_generation_prompt=False)
        assert longer.startswith(short)
