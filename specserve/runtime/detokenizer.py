"""Incremental detokenization that never emits half a UTF-8 character.

Text becomes final once decoding the ids since the last final text gives a longer string not
ending in U+FFFD (an incomplete character). Tokens that change how earlier ones decode (e.g.
a leading space) are decoded with the tokens just before them (`prefix_offset`); the first
output tokens with the prompt's last ones (`prompt_context`), since a SentencePiece-style
decoder drops the leading space of a sequence's first token: an answer's first word
"\u2581Paris" decoded alone would lose its space.

A fast tokenizer whose `decode` is its Rust backend's decode alone runs that rule in Rust
(`tokenizers.decoders.DecodeStream`): about 2.5 us a token against 19 us for two Python-level
`decode` calls. Every request detokenizes every step on the engine's loop, so at large batches
this was most of a step's host time. Other tokenizers run the same rule through their own
`decode`.
"""

from __future__ import annotations

import logging

try:
    from tokenizers import Tokenizer as _RustTokenizer
    from tokenizers.decoders import DecodeStream
except ImportError:  # (tokenizers < 0.21: no streaming decoder; the rule runs in Python)
    _RustTokenizer = DecodeStream = None


log = logging.getLogger(__name__)

# Text that transformers' clean-up (`clean_up_tokenization`) changes: spaces before
# punctuation and contractions.
_CLEAN_UP_PROBE = "a . b , c ! d ? e n't f 'm g 's h 've i 're"
_CLEAN_UP_PATTERNS = (" .", " ,", " !", " ?", " n't")


def _cleans_up(tokenizer, backend) -> bool:
    """Whether `tokenizer.decode` runs a clean-up of its own. The flag alone does not say:
    transformers 5 skips the clean-up for BPE models whatever the flag (so the packaged
    model's tokenizer streams on every version), earlier versions apply it."""
    try:
        ids = backend.encode(_CLEAN_UP_PROBE, add_special_tokens=False).ids
        ours = tokenizer.decode(ids, skip_special_tokens=False)
        theirs = backend.decode(ids, skip_special_tokens=False)
    except Exception as e:  # a tokenizer that cannot say: its own decode stays the one used
        log.debug("clean-up probe failed (%s): detokenizing through decode", e)
        return True
    if any(pattern not in theirs for pattern in _CLEAN_UP_PATTERNS):
        return True  # the vocabulary lost the probe's punctuation: no evidence either way
    return ours != theirs


def stream_backend_of(tokenizer):
    """The Rust tokenizer that decodes exactly as `tokenizer.decode` does, or None: its
    `decode` must add nothing of its own (no clean-up of spaces around punctuation)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if DecodeStream is None or not isinstance(backend, _RustTokenizer):
        return None
    # a model's own tokenizer class may decode its own way (e.g. Whisper's timestamps)
    decode = getattr(type(tokenizer), "_decode", None)
    if decode is not None and not decode.__module__.startswith("transformers.tokenization_"):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False) and _cleans_up(tokenizer, backend):
        return None
    return backend


_FIND = object()

# The most prompt tokens the first output tokens are decoded after.
CONTEXT_TOKENS = 8


def prompt_context(tokenizer, prompt_ids, skip_special_tokens: bool = True) -> list[int]:
    """The prompt's shortest tail (at most CONTEXT_TOKENS) that decodes to whole characters:
    the output decodes after it as it does in the whole text. Empty when none does (a prompt
    ending inside a character: the output's text then starts afresh)."""
    for n in range(1, min(len(prompt_ids), CONTEXT_TOKENS) + 1):
        text = tokenizer.decode(prompt_ids[-n:], skip_special_tokens=skip_special_tokens)
        if text and "\ufffd" not in text:
            return list(prompt_ids[-n:])
    return []


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer, skip_special_tokens: bool = True, stream_backend=_FIND, context=()
    ):
        """stream_backend: `stream_backend_of(tokenizer)` when the caller already has it (it is
        one per tokenizer; finding it decodes a probe). context: the ids the text follows
        (`prompt_context`), decoded before the first token but not part of the text."""
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.context = list(context)
        self.ids: list[int] = list(self.context)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self._backend = stream_backend_of(tokenizer) if stream_backend is _FIND else stream_backend
        self._stream = None
        if self._backend is not None:
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            for t in self.context:  # (their text is the context's, not ours)
                self._stream.step(self._backend, t)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def append(self, token_id: int) -> str:
        """Add one token; return the text that became final with it (maybe empty)."""
        self.ids.append(token_id)
        if self._stream is not None:
            try:
                text = self._stream.step(self._backend, token_id)
            except Exception as e:
                # tokenizers' stream gives up on some byte tokens that are not UTF-8 (a byte
                # fallback's stray bytes): the rule below goes on from where it was
                log.debug("streaming decode failed (%s): decoding through decode", e)
                self._stream = None
            else:
                if not text:
                    return ""
                # (the offsets the rule below would have: `flush` and a fallback read them)
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
                return text
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix) :]
        return ""

    def text_of(self, ids: list[int]) -> str:
        """The text `append` then `flush` would give for `ids` from the start (after the same
        context), decoded at once: a fresh stream decodes as the backend's decode of the whole
        sequence does."""
        if self._stream is not None:
            before = self._backend.decode(self.context, skip_special_tokens=self.skip)
            full = self._backend.decode(self.context + list(ids), skip_special_tokens=self.skip)
            # (bytes that are not UTF-8 decode apart differently than in one piece: such text
            # is decoded as it streams)
            if full.startswith(before) and "\ufffd" not in full:
                return full[len(before) :]
            backend = self._backend
        else:
            backend = None
        fresh = IncrementalDetokenizer(self.tokenizer, self.skip, backend, self.context)
        return "".join(fresh.append(t) for t in ids) + fresh.flush()

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        if self._stream is not None:  # later tokens decode afresh, as the rule above does
            self._stream = DecodeStream(skip_special_tokens=self.skip)
        return full[len(prefix) :] if len(full) > len(prefix) else ""
