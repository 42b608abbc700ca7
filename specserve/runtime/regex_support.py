"""Which regular-expression escapes structured output reads differently from Python's `re`
(the regex dialect of SGLang and vLLM): xgrammar takes an escaped letter it does not know as
that letter, so such a pattern is refused rather than enforced as something else. Used for
`regex` requests and for the `pattern` of a JSON schema.
"""

from __future__ import annotations

# Letters xgrammar reads as escapes (or refuses itself: \b outside a class, \k, \p). Any
# other escaped letter it takes as that letter, where Python's re (the regex dialect of SGLang
# and vLLM) gives it a meaning or refuses it: \A[a-z]+\Z allowed "AabZ".
_ESCAPE_LETTERS = frozenset("aefnrtvdDsSwWbBxucpPk")
REGEX_ESCAPES = r"\d \D \s \S \w \W \n \r \t \f \v \a \e \0 \xHH \uHHHH \cX"


def literal_escape(regex: str) -> str | None:
    """The first escape in `regex` of a letter xgrammar would take literally, if any."""
    i = regex.find("\\")
    while 0 <= i < len(regex) - 1:
        c = regex[i + 1]
        if c.isascii() and c.isalpha() and c not in _ESCAPE_LETTERS:
            return "\\" + c
        i = regex.find("\\", i + 2)  # (past the escaped character: \\A is a backslash, A)
    return None


def python_regex(regex: str) -> str:
    """`regex` as xgrammar reads it with Python's re meaning: each unescaped '.' outside a
    character class as `[^\\n]` (xgrammar's dot takes a newline, Python's, without the DOTALL
    flag xgrammar refuses, does not: "a.{3}" finished with "a\\n\\n\\n", an output the
    client's re.fullmatch rejects), and each newline character as the escape `\\n` (xgrammar
    refuses one inside a class, Python's re takes it)."""
    out, i, in_class = [], 0, False
    while i < len(regex):
        c = regex[i]
        if c == "\\":
            out.append(regex[i : i + 2])
            i += 2
            continue
        if c == "\n":
            c = "\\n"
        elif in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            # (a ']' first in a class, after an optional '^', is a literal bracket)
            close = i + 1 + (regex[i + 1 : i + 2] == "^")
            if regex[close : close + 1] == "]":
                out.append(regex[i : close + 1])
                i = close + 1
                continue
        elif c == ".":
            c = "[^\\n]"
        out.append(c)
        i += 1
    return "".join(out)
