"""Finding measured figures in prose: a ratio, a measured time, size or rate, a dated run.

A measured figure goes stale with the next run, so it lives in a results file
(``docs/performance/*.json``) and the pages made from it, never in a hand-written page,
a comment or a docstring. These patterns find the forms such figures take in this
project's prose: ``0.93x``, ``1.04-1.42 s``, ``4.7 KB``, ``550 refusals a second``,
``from 521 ms to 57 ms``, ``358.9 ± 5.1``, ``435 → 453``, ``about 30 us``, "on 26
November", and the outcome of a run told in words: "held a limit of 101", "between 6 and
47", "531 to 544 a second", "about a third", "53 s here", "8x: 16 s", "measured once at
120 ms". A setting's value is written as a whole number in its own unit (``500 ms``,
not ``0.5 s``), which none of them matches. Code, sample output and log lines quoted in
backticks or fenced blocks are left out: they show a format, not a claim.
"""

from __future__ import annotations

import io
import re
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["Figure", "in_markdown", "in_python"]

_TIME = r"(?:ns|µs|us|ms|s|seconds?|minutes?)"
_SIZE = r"(?:B|KB|KiB|MB|MiB|GB|GiB|%)"
_NUM = r"\d[\d,]*(?:\.\d+)?"
_ALONE = r"(?<![\w.])"
PATTERNS = {
    "ratio": rf"{_ALONE}\d+\.\d+x\b|{_ALONE}\d+(?:\.\d+)?[-\u2013]\d+(?:\.\d+)?x\b",
    "decimal time": rf"{_ALONE}\d+\.\d+\s?{_TIME}\b",
    "decimal size": rf"{_ALONE}\d+\.\d+\s?{_SIZE}(?!\w)",
    "range": rf"{_ALONE}{_NUM}\s?(?:[-\u2013]|to)\s?{_NUM}\s?(?:{_TIME}|{_SIZE})(?!\w)",
    "from-to": rf"\bfrom {_NUM}\s?(?:{_TIME}|{_SIZE})? to {_NUM}\s?(?:{_TIME}|{_SIZE})(?!\w)",
    "rate": rf"{_ALONE}{_NUM}\s?(?:calls|requests|answers|spans|refusals)"
    r"(?:/s| a second| per second)",
    "about": rf"\b(?:about|took|measured|median of|p50 of|p99 of)\s~?{_NUM}\s?"
    rf"(?:{_TIME}|{_SIZE})(?!\w)",
    "plus-minus": rf"{_ALONE}{_NUM}\s?±\s?{_NUM}",
    "arrow": rf"{_ALONE}{_NUM}\s?→\s?{_NUM}",
    "outcome": r"\b(?:held|reached|peaked at|fell to|rose to|settled at|stayed at)\s"
    rf"(?:an? |the )?(?:[a-z]+ )?(?:of |at )?{_NUM}(?![\w.])",
    "between": rf"\bbetween {_NUM} and {_NUM}(?!\.?\d)(?!\w| times)",
    "range rate": rf"{_ALONE}{_NUM}\s?(?:to|[-\u2013])\s?{_NUM}\s(?:[a-z]+\s)?"
    r"(?:a|per) second",
    "share": r"\b(?:about|roughly|nearly|almost) (?:a|one|two) "
    r"(?:third|quarter|fifth|sixth|tenth)s?\b",
    "here": rf"{_ALONE}{_NUM}\s?{_TIME}\s(?:here|on this machine|in this run)\b",
    "times ratio": rf"{_ALONE}\d+x:\s?{_NUM}\s?{_TIME}\b",
    "measured at": rf"\bmeasured (?:[a-z]+ )?at {_NUM}\s?(?:{_TIME}|{_SIZE})(?!\w)",
    "dated run": r"\b\d{1,2} (?:January|February|March|April|May|June|July|August|"
    r"September|October|November|December)\b",
}
_COMPILED = {kind: re.compile(pattern) for kind, pattern in PATTERNS.items()}
_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"`[^`]*`")


@dataclass(frozen=True)
class Figure:
    """One figure found: where, of which kind, and the text that matched."""

    line: int
    kind: str
    text: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.kind} {self.text!r}"


def in_markdown(text: str) -> list[Figure]:
    """The figures in a Markdown page's prose (fenced blocks and code spans left out)."""
    lines, fenced = [], False
    for line in text.split("\n"):
        if _FENCE.match(line):
            fenced = not fenced
            line = ""
        lines.append("" if fenced else line)
    prose = _CODE_SPAN.sub(lambda m: "\n" * m.group(0).count("\n"), "\n".join(lines))
    return list(_scan(prose.split("\n")))


def in_python(source: str) -> list[Figure]:
    """The figures in a module's comments and docstrings (code and other strings left out)."""
    lines = [""] * (source.count("\n") + 1)
    previous = tokenize.NEWLINE
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        is_docstring = token.type == tokenize.STRING and previous in (
            tokenize.NEWLINE,
            tokenize.INDENT,
            tokenize.DEDENT,
            tokenize.NL,
        )
        if token.type == tokenize.COMMENT or is_docstring:
            for offset, text in enumerate(token.string.split("\n")):
                lines[token.start[0] - 1 + offset] += " " + text
        if token.type not in (tokenize.NL, tokenize.COMMENT):
            previous = token.type
    return in_markdown("\n".join(_without_literal_blocks(lines)))


def _without_literal_blocks(lines: list[str]) -> list[str]:
    """reST literal blocks (the indented lines after a line ending ``::``) blanked: samples."""
    out: list[str] = []
    block_indent = None
    for line in lines:
        text = line.strip()
        indent = len(line) - len(line.lstrip())
        if block_indent is not None and (not text or indent > block_indent):
            out.append("")
            continue
        block_indent = indent if text.endswith("::") else None
        out.append(line)
    return out


def _scan(lines: list[str]) -> Iterator[Figure]:
    for number, line in enumerate(lines, 1):
        for kind, pattern in _COMPILED.items():
            for match in pattern.finditer(line):
                yield Figure(number, kind, match.group(0))
