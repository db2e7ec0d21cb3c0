"""regen's length filter counts the target's own tokens (the tiny target's tokenizer and chat template).

(Moved from tests/unit/test_regen_adapters.py: it reads the tiny target, so it belongs to the component tier.)"""

from __future__ import annotations

from eaglenest.regen.formats import TOO_LONG, TOO_SHORT, conversation_tokens, length_problem


def test_length_filter_counts_target_tokens(tiny_target_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target_path)
    short = [{"role": "user", "content": "What is 2 plus 2?"}, {"role": "assistant", "content": "4."}]
    n = conversation_tokens(tok, short, None)
    assert n == len(tok.encode(tok.apply_chat_template(short, tokenize=False), add_special_tokens=False))
    assert length_problem(n, 1, n) is None
    assert length_problem(n, 1, n - 1)[0] == TOO_LONG
    assert length_problem(n, n + 1, 10_000)[0] == TOO_SHORT
