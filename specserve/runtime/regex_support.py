"""Which regular expressions structured output reads differently from Python's `re` (the
regex dialect of SGLang and vLLM), refused rather than enforced as something else (`unread`:
xgrammar takes an escaped letter it does not know as that letter, \\A[a-z]+\\Z allowing
"AabZ"), and what of a JSON schema's `pattern` it would put into the JSON text raw
(`json_unsafe`). Used for `regex` requests and for the `pattern` of a JSON schema.
"""

from __future__ import annotations

import re

# Letters xgrammar reads as escapes (or refuses itself: \b outside a class, \k, \p). Any
# other escaped letter it takes as that letter, where Python's re (the regex dialect of SGLang
# and vLLM) gives it a meaning or refuses it: \A[a-z]+\Z allowed "AabZ".
_ESCAPE_LETTERS = frozenset("aefnrtvdDsSwWbBxucpPk")
REGEX_ESCAPES = r"\d \s \w \n \r \t \f \v \a \0 \xHH \uHHHH"
# what Python's re takes for \s in a str pattern (str.isspace's characters), as a class's
# members: xgrammar's \s is ASCII alone, so its \S let in a no-break space
PYTHON_SPACE = r"\t\n\x0b\x0c\r\x1c-\x1f \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
# escapes of control characters: a JSON string may not hold them raw
_CONTROL_ESCAPES = frozenset("nrtfvae0c")


def python_error(regex: str) -> str | None:
    """Why Python's re refuses `regex` (None: it compiles). The grammar compiler serves some
    of those (\\e, \\cA, [\\d-z]) with a meaning of its own."""
    try:
        re.compile(regex)
    except re.error as e:
        return str(e)
    except (RecursionError, OverflowError) as e:  # (nested or repeated past re's limits)
        return f"{type(e).__name__}: {e}"
    return None


def unread(regex: str, spaces_translated: bool = False) -> str | None:
    """The first part of `regex` that structured output would not read as Python's re does,
    described (None: there is none): an escaped letter it takes as the letter; an octal
    escape or a backreference (\\01 read as \\0 then 1); an anchor inside the pattern
    (a$b, x(^a): ignored); a lookaround or flag group; a negated shorthand (\\W, \\D, \\S,
    or \\w, \\d, \\s in a negated class: ASCII there, so they let in letters and digits of
    other scripts, which Python's re, reading Unicode, excludes; spaces_translated: \\S, and
    \\s in a negated class, pass, as `python_regex` spells them out)."""
    in_class = negated = False
    class_start = -1  # (a ']' there is a literal bracket)
    i, n = 0, len(regex)
    while i < n:
        c = regex[i]
        if c == "\\" and i + 1 < n:
            e = regex[i + 1]
            if e.isascii() and e.isalpha() and e not in _ESCAPE_LETTERS:
                return f"the escape \\{e}, read as the letter {e}"
            if e.isdigit() and (e != "0" or regex[i + 2 : i + 3].isdigit()):
                return f"the escape {regex[i : i + 3]!r} (an octal escape or a backreference)"
            spaces = spaces_translated and (e == "s" or (e == "S" and not in_class))
            if not spaces and (e in "WDS" or (in_class and negated and e in "wds")):
                return f"\\{e}{' in a class' if in_class else ''} (ASCII only there)"
            i += 2
            continue
        if in_class:
            if c == "]" and i != class_start:
                in_class = False
        elif c == "[":
            in_class, negated = True, regex[i + 1 : i + 2] == "^"
            class_start = i + 1 + negated
        elif c == "(" and regex[i + 1 : i + 2] == "?" and regex[i + 2 : i + 3] != ":":
            return f"the group {regex[i : i + 3]!r}... (lookarounds and flags are not read)"
        elif (c == "^" and i > 0) or (c == "$" and i < n - 1):
            return f"the anchor {c!r} inside the pattern"
        i += 1
    return None


def json_unsafe(pattern: str) -> str | None:
    """What in a JSON schema's `pattern` the grammar would put into the JSON text raw,
    breaking it, described (None: nothing): a quote, a backslash or a control character
    named in it (classes, '.' and shorthands leave them out)."""
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == '"':
            return "a quote"
        if ord(c) < 0x20:
            return f"the control character {c!r}"
        if c == "\\" and i + 1 < n:
            e = pattern[i + 1]
            if e == '"' or e == "\\":
                return "a quote" if e == '"' else "a backslash"
            if e in _CONTROL_ESCAPES:
                return f"the control character \\{e}"
            if e in "xu":
                digits = pattern[i + 2 : i + (4 if e == "x" else 6)]
                try:
                    code = int(digits, 16)
                except ValueError:
                    code = None
                if code is not None and (code < 0x20 or code in (0x22, 0x5C)):
                    return f"the character \\{e}{digits}"
            i += 2
            continue
        i += 1
    return None


# UTF-16 surrogates: no text holds them, but xgrammar's '.' and negated classes took their
# three-byte forms ("a.b" finished "stop" as bytes no UTF-8 decoder reads: 'a\ufffd...b')
SURROGATES = "\\ud800-\\udfff"


def _class_atom(regex: str, i: int) -> tuple[int | None, int]:
    """(code point, end) of the class member at i: a character, \\xHH, \\uHHHH or an
    escaped punctuation mark; None for anything else (\\d, ...)."""
    if regex[i] != "\\":
        return ord(regex[i]), i + 1
    kind = regex[i + 1 : i + 2]
    digits = {"x": 2, "u": 4}.get(kind)
    if digits:
        hex_digits = regex[i + 2 : i + 2 + digits]
        if len(hex_digits) == digits and all(d in "0123456789abcdefABCDEF" for d in hex_digits):
            return int(hex_digits, 16), i + 2 + digits
        return None, i + 2
    if kind and not kind.isalnum():
        return ord(kind), i + 2
    return None, i + 2


def _class_range(regex: str, i: int) -> tuple[str, int] | None:
    """The range of a positive class at i, as the grammar is given it (one that spans the
    surrogates as the ranges either side of them), and where it ends; None where no range
    starts at i."""
    if regex[i] == "]":
        return None
    low, end = _class_atom(regex, i)
    if low is None or regex[end : end + 1] != "-" or regex[end + 1 : end + 2] in ("", "]"):
        return None
    high, end = _class_atom(regex, end + 1)
    if high is None:
        return None
    parts = [(low, high)]
    if low <= 0xDFFF and high >= 0xD800:
        parts = [(low, 0xD7FF)] if low <= 0xD7FF else []
        parts += [(0xE000, high)] if high >= 0xE000 else []
    if not parts:  # (surrogates alone: left as written)
        parts = [(low, high)]
    return "".join(f"{_class_char(a)}-{_class_char(b)}" for a, b in parts), end


def _class_char(code: int) -> str:
    """A class member as an escape the grammar reads (astral characters as themselves)."""
    return f"\\u{code:04x}" if code <= 0xFFFF else chr(code)


def python_regex(regex: str) -> str:
    """`regex` as xgrammar reads it with Python's re meaning: each unescaped '.' outside a
    character class as `[^\\n]` (xgrammar's dot takes a newline, Python's, without the DOTALL
    flag xgrammar refuses, does not: "a.{3}" finished with "a\\n\\n\\n", an output the
    client's re.fullmatch rejects), and each newline character as the escape `\\n` (xgrammar
    refuses one inside a class, Python's re takes it), and \\S, and \\s in a negated class,
    as Python's whitespace (`PYTHON_SPACE`; \\S in a positive class `unread` refuses); and
    '.', \\S, negated classes and ranges that span them without the surrogates
    (`SURROGATES`)."""
    out, i, in_class, negated = [], 0, False, False
    while i < len(regex):
        c = regex[i]
        if in_class and not negated and (span := _class_range(regex, i)):
            out.append(span[0])  # (a range whole: its last character starts no other)
            i = span[1]
            continue
        if c == "\\":
            end = i + 2
            if in_class and regex[i + 1 : i + 2] in ("x", "u"):  # (its digits with it: no
                end = _class_atom(regex, i)[1]  # range starts part-way through it)
            escape = regex[i:end]
            if escape == "\\S" and not in_class:
                escape = f"[^{PYTHON_SPACE}{SURROGATES}]"
            elif escape == "\\s" and in_class and negated:
                escape = PYTHON_SPACE
            out.append(escape)
            i = end
            continue
        if c == "\n":
            c = "\\n"
        elif in_class:
            in_class = c != "]"
        elif c == "[":
            in_class, negated = True, regex[i + 1 : i + 2] == "^"
            close = i + 1 + negated
            opening = "[^" + SURROGATES if negated else "["
            # (a ']' first in a class, after an optional '^', is a literal bracket: escaped,
            # since xgrammar closes the class there)
            if regex[close : close + 1] == "]":
                out.append(opening + "\\]")
                i = close + 1
                continue
            out.append(opening)
            i = close
            continue
        elif c == ".":
            c = "[^\\n" + SURROGATES + "]"
        out.append(c)
        i += 1
    return "".join(out)
