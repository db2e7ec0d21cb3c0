"""Write eaglenest/assets/tiny_corpus.jsonl: the chats the tiny target is pre-trained on (run once; output is shipped).

The text is structured (arithmetic, counting, code, tool calls, reasoning) so that the next token depends on the
context through the model's hidden states, not only on the previous token: a drafter fed the wrong layers fails.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy"]
ITEMS = ["apples", "books", "coins", "stones", "shells", "cards", "pens", "cups", "keys", "maps"]
CITIES = ["paris", "tokyo", "lima", "oslo", "cairo", "quito", "seoul", "rome", "dakar", "hanoi"]
WORDS = ["red", "blue", "green", "fast", "slow", "small", "large", "bright", "quiet", "warm", "cold", "old", "new"]
NUM = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def arithmetic(r: random.Random) -> dict:
    a, b = r.randint(2, 60), r.randint(2, 40)
    op, res = r.choice([("plus", a + b), ("minus", a - b), ("times", a * b)])
    q = f"What is {a} {op} {b}?"
    think = f"I need {a} {op} {b}. Compute step by step: {a} {op} {b} = {res}."
    return {"messages": [{"role": "user", "content": q},
                         {"role": "assistant", "reasoning_content": think if r.random() < 0.5 else None,
                          "content": f"{a} {op} {b} is {res}. The answer is {res}."}]}


def counting(r: random.Random) -> dict:
    start, step, n = r.randint(0, 30), r.randint(1, 5), r.randint(4, 9)
    seq = ", ".join(str(start + i * step) for i in range(n))
    return {"messages": [{"role": "user", "content": f"Count from {start} in steps of {step}, {n} numbers."},
                         {"role": "assistant", "content": f"Here they are: {seq}. That is {n} numbers."}]}


def story(r: random.Random) -> dict:
    who, item, city = r.choice(NAMES), r.choice(ITEMS), r.choice(CITIES)
    k = r.randint(1, 9)
    adj = r.choice(WORDS)
    return {"messages": [{"role": "system", "content": "You are a helpful assistant."},
                         {"role": "user", "content": f"Tell me about {who} in {city}."},
                         {"role": "assistant", "content": f"{who.title()} lives in {city.title()} and keeps {NUM[k]} "
                          f"{adj} {item}. Every day {who} counts the {item}: {NUM[k]} {item} in {city.title()}."},
                         {"role": "user", "content": f"How many {item} does {who} keep?"},
                         {"role": "assistant",
                          "content": f"{who.title()} keeps {NUM[k]} {item}, so the answer is {k}."}]}


def code(r: random.Random) -> dict:
    name = r.choice(["add", "scale", "shift", "mix", "clip"])
    a, b = r.choice(NAMES)[:1], r.choice(["x", "y", "z", "n"])
    k = r.randint(2, 9)
    body = {
        "add": f"return {a} + {b} + {k}",
        "scale": f"return {a} * {k} + {b}",
        "shift": f"return ({a} << {k}) | {b}",
        "mix": f"return ({a} + {b}) * {k}",
        "clip": f"return max({b}, min({a}, {k}))",
    }[name]
    src = f"def {name}_{k}({a}, {b}):\n    {body}\n"
    return {"messages": [{"role": "user", "content": f"Write a python function {name}_{k} of {a} and {b}."},
                         {"role": "assistant", "content": f"```python\n{src}```\nCall {name}_{k}(1, 2) to use it."}]}


def tool(r: random.Random) -> dict:
    city = r.choice(CITIES)
    temp = r.randint(-5, 35)
    call = {"name": "get_weather", "arguments": {"city": city}}
    return {"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object", "properties": {"city": {"type": "string"}}}}}],
            "messages": [{"role": "user", "content": f"What is the weather in {city}?"},
                         {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
                         {"role": "tool", "content": json.dumps({"city": city, "celsius": temp})},
                         {"role": "assistant", "content": f"It is {temp} degrees celsius in {city.title()}."}]}


def main() -> None:
    r = random.Random(1234)
    makers = [arithmetic, counting, story, code, tool]
    rows = [r.choice(makers)(r) for _ in range(2000)]
    for row in rows:
        for m in row["messages"]:
            if m.get("reasoning_content") is None:
                m.pop("reasoning_content", None)
    out = Path(__file__).resolve().parents[1] / "eaglenest" / "assets" / "tiny_corpus.jsonl"
    out.write_text("".join(json.dumps(x, sort_keys=True) + "\n" for x in rows))
    print(f"wrote {len(rows)} chats, {out.stat().st_size} bytes to {out}")


if __name__ == "__main__":
    main()
