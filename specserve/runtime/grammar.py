"""Structured output: a request's grammar (a JSON schema, a regular expression or an EBNF
grammar, SGLang's `json_schema` / `regex` / `ebnf`) decides which tokens may come next,
through xgrammar.

A constrained request's matcher holds the state after every token it has emitted. Before the
target draws at a node of a draft tree, that node's logits are masked to what the grammar
allows after the path from the root to the node (`tree_bitmask`), so a draw, and therefore
every accepted draft token and bonus token, is one the grammar allows: speculative output
equals plain output under a grammar as without one. Drafts themselves are not constrained:
a draft token the grammar forbids is never drawn by the target at its parent, so it is
never accepted.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

import torch

from specserve.errors import InvalidArgument
from specserve.runtime.json_schema_support import SUPPORTED, unenforced, with_patterns
from specserve.runtime.regex_support import REGEX_ESCAPES, python_error, python_regex, unread
from specserve.sampling_params import GRAMMAR_PARAMS

# xgrammar's error text starts with its log prefix: "[18:30:28] /project/cpp/x.cc:94: ", and
# a failed assertion's with its C++ condition: "Check failed: (val <= MAX_INT64_AS_DOUBLE) is
# false: "
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")

# Compiled grammars kept for reuse (each holds token-mask tables): least recently used ones
# go past this (vLLM's default), so clients sending ever new schemas cannot grow the host's
# memory without bound.
CACHE_BYTES = 512 * 2**20
# Grammars checked and compiled lately, by (field, text): a batch's prompts sharing a schema,
# and a prompt's samples, check it once (parsing and walking a large schema costs about
# 8 ms per MB each time). Few: a large schema's text is held while it is cached.
CHECKED_GRAMMARS = 16


def _xgrammar(field: str = "json_schema"):
    try:
        import xgrammar
    except ImportError as e:  # (a dependency of the package; a hand-made environment may lack it)
        raise InvalidArgument(
            field, f"structured output needs xgrammar, which is not importable: {e}"
        ) from e
    return xgrammar


class GrammarCompiler:
    """Compiles requests' grammars for one tokenizer (compiled grammars are cached by text,
    so the samples of a prompt and repeated schemas compile once)."""

    def __init__(self, tokenizer, vocab_size: int, unsupported: str | None = None):
        """unsupported: why this engine refuses structured output (None: it serves it)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.unsupported = unsupported
        self._compiler = None
        self._lock = threading.Lock()  # built once, by whichever thread asks first
        self._checked: OrderedDict[tuple[str, str], object] = OrderedDict()

    def _get(self, field: str):
        with self._lock:
            if self._compiler is None:
                xgr = _xgrammar(field)
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size
                )
                self._compiler = xgr.GrammarCompiler(info, cache_limit_bytes=CACHE_BYTES)
            return self._compiler

    def is_compiled(self, field: str, spec: str) -> bool:
        """Whether `compile(field, spec)` answers from the cache (at once)."""
        with self._lock:
            return (field, spec) in self._checked

    def compile(self, field: str, spec: str):
        """The compiled grammar of `spec` given as sampling parameter `field`."""
        if self.unsupported is not None:
            raise InvalidArgument(field, f"structured output {self.unsupported}")
        key = (field, spec)
        with self._lock:
            if key in self._checked:
                self._checked.move_to_end(key)
                return self._checked[key]
        compiled = self._check_and_compile(field, spec)
        with self._lock:
            self._checked[key] = compiled
            while len(self._checked) > CHECKED_GRAMMARS:
                self._checked.popitem(last=False)
        return compiled

    def _check_and_compile(self, field: str, spec: str):
        if field == "json_schema":
            try:
                schema = json.loads(spec, parse_constant=_not_json, parse_float=_finite)
                unsupported = unenforced(schema)
            except _OutOfRange as e:
                raise InvalidArgument(field, str(e)) from None
            except ValueError as e:
                raise InvalidArgument(field, f"is not valid JSON: {e}") from None
            except RecursionError:  # (past Python's stack: ~1,000 levels of arrays or objects)
                raise InvalidArgument(field, "is nested too deeply to be parsed") from None
            if unsupported:
                shown = "; ".join(unsupported[:8]) + ("; ..." if len(unsupported) > 8 else "")
                raise InvalidArgument(
                    field,
                    f"uses what structured output cannot enforce ({shown}); supported: {SUPPORTED}",
                )
            # (a pattern read as a regex is: no newline for '.', no surrogate anywhere)
            patterned = with_patterns(schema, python_regex)
            if patterned != schema:
                spec = json.dumps(patterned)
        if field == "regex" and (error := python_error(spec)) is not None:
            raise InvalidArgument(
                field, f"is not a valid regular expression (read as Python's re): {error}"
            )
        if field == "regex" and (what := unread(spec, spaces_translated=True)) is not None:
            raise InvalidArgument(
                field,
                f"uses {what}, which structured output does not read as Python's re does; "
                f"supported: {REGEX_ESCAPES}, escaped punctuation, classes, groups, (?:...), "
                "and ^ and $ at the ends",
            )
        compiler = self._get(field)
        try:
            if field == "json_schema":
                # (strict mode, as vLLM and SGLang compile schemas: no properties beyond
                # those listed unless additionalProperties allows them)
                compiled = _compile_json_schema(compiler, spec)
            elif field == "regex":
                compiled = _compile_regex(compiler, spec)
            else:
                compiled = compiler.compile_grammar(spec)
        except Exception as e:  # xgrammar reports a bad schema / pattern as a RuntimeError
            why = _LOG_PREFIX.sub("", str(e).strip()) or "the compiler gave no reason"
            raise InvalidArgument(field, f"cannot be compiled: {why}") from None
        first = new_bitmask(1, self.vocab_size)
        RequestGrammar(compiled, field).fill_next(first, 0)
        if not first.any():
            raise InvalidArgument(field, "no token of the vocabulary can begin an output of it")
        return compiled


# The character classes xgrammar gives a JSON string's characters, and the one they become:
# a bounded string's (minLength / maxLength) let control characters other than CR and LF
# through raw, which JSON forbids in a string (a random walk of {"type": "string",
# "maxLength": 3} gave unparseable output a third of the time), and both let a surrogate
# through, which UTF-8 cannot encode (its bytes came out as three replacement characters).
_JSON_STRING_CLASSES = (r"[^\"\\\r\n]", r"[^\0-\x1f\"\\\r\n]")
_JSON_STRING_CLASS = r"[^\0-\x1f\"\\\ud800-\udfff]"


def _compile_json_schema(compiler, spec: str):
    """A JSON schema compiled as xgrammar does, but for the characters of its strings."""
    grammar = _xgrammar().Grammar
    text = str(grammar.from_json_schema(spec))
    fixed = text
    for cls in _JSON_STRING_CLASSES:
        fixed = fixed.replace(cls, _JSON_STRING_CLASS)
    if fixed == text:
        return compiler.compile_json_schema(spec)
    return compiler.compile_grammar(grammar.from_ebnf(fixed))


def _compile_regex(compiler, spec: str):
    """A regex compiled with Python's meaning (runtime/regex_support.py `python_regex`)."""
    try:
        return compiler.compile_regex(python_regex(spec))
    except Exception:
        # (the same error again, at its position in the client's own pattern)
        compiler.compile_regex(spec)
        raise


class _OutOfRange(ValueError):
    pass


def _finite(text: str) -> float:
    """A JSON number as a float, refused past a double's range (1e400 read as infinity, and
    the compiler then failed without a reason)."""
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise _OutOfRange(f"holds the number {text}, past a double's range (about 1.8e308)")
    return value


def _not_json(name: str):
    """NaN and Infinity: Python's json takes them, JSON (and xgrammar, whose error then
    echoed the whole schema) does not."""
    raise ValueError(f"{name} is not a JSON value")


def grammar_spec(params) -> tuple[str, str] | None:
    """(field, text) of the grammar a request's sampling parameters ask for, if any."""
    for name in GRAMMAR_PARAMS:
        value = getattr(params, name)
        if value is not None:
            return name, value
    return None


class RequestGrammar:
    """One request's grammar state: the tokens it has emitted, accepted in order."""

    def __init__(self, compiled, field: str = "json_schema"):
        """field: the sampling parameter that gave the grammar (errors name it)."""
        xgr = _xgrammar(field)
        self.matcher = xgr.GrammarMatcher(compiled)
        self.field = field

    def accept(self, tokens) -> bool:
        """Advance over emitted tokens; False if one of them leaves the grammar."""
        return all(self.matcher.accept_token(int(t)) for t in tokens)

    def take(self, tokens: list[int]) -> tuple[list[int], str | None]:
        """Advance over a step's tokens as far as the grammar goes: (the tokens taken, None
        if all of them were; "complete" if the last one taken completed the grammar;
        "refused" if the one after them left it)."""
        for i, t in enumerate(tokens):
            if not self.matcher.accept_token(int(t)):
                return tokens[:i], "refused"
            if self.matcher.is_terminated():
                return tokens[: i + 1], "complete"
        return tokens, None

    @property
    def terminated(self) -> bool:
        """The grammar is complete (its stop token accepted): nothing may follow."""
        return self.matcher.is_terminated()

    def fill_next(self, bitmask: torch.Tensor, index: int) -> None:
        """bitmask[index]: the tokens allowed after what has been emitted."""
        self.matcher.fill_next_token_bitmask(bitmask, index)
        if not self.matcher.is_completed():
            _forbid(bitmask[index], self.matcher.stop_token_ids)

    def fill_tree(self, tokens: torch.Tensor, parents: torch.Tensor, bitmask: torch.Tensor):
        """bitmask[i] for each node i of one draft tree (node 0: the root, the last emitted
        token): the tokens allowed after the path to node i. A node whose own token the grammar
        forbids is never accepted; its row comes back empty (see `allow_where_empty`)."""
        parent_list = parents.tolist()
        first_child, next_sibling = _child_links(parent_list)
        self.matcher.traverse_draft_tree(
            torch.tensor(first_child), torch.tensor(next_sibling), tokens, bitmask
        )
        self._forbid_early_stops(tokens.tolist(), parent_list, bitmask)

    def _forbid_early_stops(self, tokens: list[int], parents: list[int], bitmask) -> None:
        """Clear the stop tokens from each row whose path leaves the grammar incomplete.
        xgrammar (0.2.9) allows a stop token where a repeated negated class or `.` ends the
        grammar before it has matched enough (`[^a]+` allowed EOS first: "" finished "stop"),
        though its matcher knows the grammar is not complete there. Only rows allowing a
        stop token are walked (few: near a grammar's end)."""
        stops = self.matcher.stop_token_ids
        for node in torch.nonzero(_allows_any(bitmask, stops)).flatten().tolist():
            path, j = [], node
            while j > 0:  # (node 0, the root, is what has been emitted)
                path.append(tokens[j])
                j = parents[j]
            matcher = self.matcher.fork()
            if _walks(matcher, reversed(path)) and not matcher.is_completed():
                _forbid(bitmask[node], stops)


def _walks(matcher, tokens) -> bool:
    """Whether the matcher takes every token, none past the grammar's end."""
    for t in tokens:
        if matcher.is_terminated() or not matcher.accept_token(t):
            return False
    return True


def _bit(token: int) -> tuple[int, int]:
    """(word, int32 value with only the token's bit set) of a token in a bitmask row."""
    value = 1 << (token % 32)
    return token // 32, value - (1 << 32) if value >= 1 << 31 else value


def _allows_any(bitmask: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """[rows] bool: whether each row allows any of `tokens`."""
    allowed = torch.zeros(bitmask.shape[0], dtype=torch.bool)
    for t in tokens:
        word, value = _bit(t)
        if word < bitmask.shape[1]:
            allowed |= (bitmask[:, word] & value) != 0
    return allowed


def _forbid(row: torch.Tensor, tokens: list[int]) -> None:
    """Clear `tokens` from one bitmask row, in place."""
    for t in tokens:
        word, value = _bit(t)
        if word < row.shape[0]:
            row[word] &= ~value


def refuse_by_grammar(req) -> None:
    """End a request whose grammar refused its next token: no token of the vocabulary
    continues it (the request's own fault: a client error, as its grammar's field says)."""
    field = req.grammar.field
    # (where the request narrowed the draw itself, say so: the grammar alone may be fine)
    narrowed = getattr(req.params, "allowed_token_ids", None)
    where = " among allowed_token_ids" if narrowed else " of the vocabulary"
    req.finish(
        "abort",
        message=f"{field}: no token{where} continues this grammar",
        status_code=400,
        param=field,
    )


def _child_links(parents: list[int]) -> tuple[list[int], list[int]]:
    """The first-child / next-sibling form of a tree given by parent indices."""
    n = len(parents)
    first_child, next_sibling, last_child = [-1] * n, [-1] * n, [-1] * n
    for node in range(1, n):
        p = parents[node]
        if p < 0:
            continue
        if first_child[p] < 0:
            first_child[p] = node
        else:
            next_sibling[last_child[p]] = node
        last_child[p] = node
    return first_child, next_sibling


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(vocab / 32)] int32 on the CPU, every token allowed (-1: all bits set)."""
    return torch.full((rows, -(-vocab_size // 32)), -1, dtype=torch.int32)


def allow_where_empty(bitmask: torch.Tensor) -> torch.Tensor:
    """Rows that allow no token allow every token instead. Such a row is a node whose own
    token the grammar forbids (it is never accepted, so its draw is unused), or a state no
    token of the vocabulary continues: a draw there leaves the grammar, and the host ends
    the request with that reason (`EngineCore`), rather than draw from no token at all."""
    bitmask[(bitmask == 0).all(dim=1)] = -1
    return bitmask


class BatchGrammar:
    """The grammars of a decode batch's requests (None: unconstrained), by batch index; the
    decode step asks it for its trees' masks (`tree_bitmask`)."""

    def __init__(self, grammars: list[RequestGrammar | None], vocab_size: int):
        self.grammars = grammars
        self.vocab_size = vocab_size

    def tree_bitmask(self, tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        """[B * N, words] bitmask of every node of the batch's [B, N] trees (device tensors:
        the host waits for the drafts here). Rows past the batch's requests (a padded batch)
        and unconstrained requests' rows allow everything."""
        b, n = tokens.shape
        tokens_h, parents_h = tokens.cpu(), parents.cpu()
        bitmask = new_bitmask(b * n, self.vocab_size)
        for i, grammar in enumerate(self.grammars):
            if grammar is None:
                continue
            rows = bitmask[i * n : (i + 1) * n]
            if n == 1:
                grammar.fill_next(rows, 0)
            else:
                grammar.fill_tree(tokens_h[i], parents_h[i], rows)
        return allow_where_empty(bitmask).to(tokens.device)


def batch_grammar(reqs, vocab_size: int) -> BatchGrammar | None:
    """The grammars of a decode batch, or None when no request of it is constrained."""
    grammars = [r.grammar for r in reqs]
    if grammars.count(None) == len(grammars):
        return None
    return BatchGrammar(grammars, vocab_size)


def next_token_bitmask(reqs, vocab_size: int, device: torch.device) -> torch.Tensor:
    """[len(reqs), words] bitmask of the tokens each request may emit next."""
    bitmask = new_bitmask(len(reqs), vocab_size)
    for i, r in enumerate(reqs):
        if r.grammar is not None:
            r.grammar.fill_next(bitmask, i)
    return allow_where_empty(bitmask).to(device)
