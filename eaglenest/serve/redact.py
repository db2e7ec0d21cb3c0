"""Redaction of the traffic log (``serve.traffic_log.redact``): personal data and secrets in text become a marker.

What is matched: email addresses, phone numbers (grouped digits with an area code), payment-card-like digit runs
(13-19 digits), IPv4 addresses and secret-like strings (``sk-...`` API keys, AWS access key ids, GitHub and Slack
tokens, ``Bearer`` tokens). Arithmetic, code and ordinary numbers stay: the patterns need the shapes above. This is
a filter for the common cases, not a guarantee: the traffic log is off by default, and docs/OPERATIONS.md says what
it stores.
"""

from __future__ import annotations

import re
from collections.abc import Callable

MARK = "[redacted]"
PATTERNS: dict[str, re.Pattern[str]] = {
    "email": re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}"),
    "secret": re.compile(r"\b(?:sk-[A-Za-z0-9_-]{16,}|AKIA[0-9A-Z]{16}|gh[pousr]_[A-Za-z0-9]{30,}"
                         r"|xox[abpr]-[A-Za-z0-9-]{10,})\b|(?i:bearer)\s+[A-Za-z0-9._~+/=-]{20,}"),
    "card": re.compile(r"(?<![\d.])(?:\d[ -]?){12,18}\d(?![\d.])"),
    "phone": re.compile(r"(?<![\w.+])(?:\+\d{1,3}[\s.-]?)?(?:\(\d{2,4}\)[\s.-]?|\d{2,4}[\s.-])\d{3,4}[\s.-]?\d{3,4}"
                        r"(?![\w.])"),
    "ipv4": re.compile(r"(?<![\d.])(?:(?:25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(?:25[0-5]|2[0-4]\d|1?\d?\d)(?![\d.])"),
}


_GITHUB_TOKEN = re.compile(r"gh[pousr]_")
_DIGIT_PAIR = re.compile(r"\d[ -]?\d")
_THREE_DIGITS = re.compile(r"\d{3}")
_DOTTED_DIGITS = re.compile(r"\d\.\d")

NEEDS: dict[str, Callable[[str], object]] = {
    "email": lambda t: "@" in t,
    "secret": lambda t: ("sk-" in t or "AKIA" in t or "xox" in t or _GITHUB_TOKEN.search(t)
                         or "bearer" in t.lower()),
    "card": _DIGIT_PAIR.search,
    "phone": _THREE_DIGITS.search,
    "ipv4": _DOTTED_DIGITS.search,
}
"""what a text must contain for each pattern to match at all (every match of the pattern contains it): a cheap test
that skips the pattern's full scan. Redaction is most of the traffic log's writer thread, which shares a serving
replica's CPU, and most chat text has no ``@``, no key prefix, no dotted or grouped digits."""


def redact(text: str, *, prefilter: bool = True) -> tuple[str, int]:
    """``text`` with every match replaced by :data:`MARK`, and how many replacements were made. ``prefilter=False``
    runs every pattern's full scan: the same result, slower (what the tests and benchmark hold the fast path to)."""
    total = 0
    for name, pattern in PATTERNS.items():
        if prefilter and not NEEDS[name](text):
            continue
        text, n = pattern.subn(MARK, text)
        total += n
    return text, total


__all__ = ["MARK", "NEEDS", "PATTERNS", "redact"]
