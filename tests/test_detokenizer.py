"""Streamed text: token by token it adds up to the whole decode, never shows half a
character, and the Rust streaming path agrees with the rule run through `decode`."""

from __future__ import annotations

import pytest

from specserve.model.registry import resolve_packaged
from specserve.model.tokenizer import load_tokenizer
from specserve.runtime.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Plain English, with punctuation: commas, full stops. And (brackets)!",
    "Emoji split over byte tokens 🦀🔥👩‍💻, then CJK 中文字符 and accents é à ü ß.",
    "  leading spaces, tabs\tand\nnew lines\n\n   trailing  ",
    "<|im_start|>user\nspecial tokens inside<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_packaged("smollm2-135m"), "gguf")


def streamed(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    pieces = [detok.append(i) for i in ids]
    pieces.append(detok.flush())
    return pieces


class _PythonOnly:
    """The same tokenizer seen only through `decode` (no Rust backend to stream with)."""

    def __init__(self, tokenizer):
        self._tok = tokenizer

    def decode(self, ids, skip_special_tokens=True):
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_is_the_whole_decode_in_pieces_without_half_characters(tokenizer, text, skip):
    ids = tokenizer.encode(text, add_special_tokens=False)
    fast = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
    assert fast._stream is not None  # the packaged model's tokenizer streams in Rust
    pieces = streamed(fast, ids)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=skip)
    assert not any("\ufffd" in p for p in pieces)
    slow = IncrementalDetokenizer(_PythonOnly(tokenizer), skip_special_tokens=skip)
    assert slow._stream is None
    assert streamed(slow, ids) == pieces  # the same pieces, at the same tokens


def test_an_incomplete_character_at_the_end_comes_out_at_flush(tokenizer):
    ids = tokenizer.encode("ok 🦀", add_special_tokens=False)
    cut = ids[:-1]  # the crab's last byte token is missing
    for tok in (tokenizer, _PythonOnly(tokenizer)):
        detok = IncrementalDetokenizer(tok)
        shown = "".join(detok.append(i) for i in cut)
        assert "\ufffd" not in shown
        assert shown + detok.flush() == tokenizer.decode(cut)


def test_a_tokenizer_that_cleans_up_spaces_decodes_through_its_own_decode(tokenizer):
    """Clean-up (transformers' `clean_up_tokenization_spaces`) is the Python tokenizer's own
    step, which the Rust stream would skip: a tokenizer whose decode cleans up is not
    streamed, and its streamed text is its own decode's."""

    class CleaningUp(_PythonOnly):
        clean_up_tokenization_spaces = True

        @property
        def backend_tokenizer(self):
            return self._tok.backend_tokenizer

        def decode(self, ids, skip_special_tokens=True):
            text = super().decode(ids, skip_special_tokens=skip_special_tokens)
            return text.replace(" .", ".").replace(" ,", ",")

    cleaning = CleaningUp(tokenizer)
    detok = IncrementalDetokenizer(cleaning)
    assert detok._stream is None
    ids = tokenizer.encode("It is here , is it .", add_special_tokens=False)
    assert "".join(streamed(detok, ids)) == cleaning.decode(ids)


def test_a_clean_up_flag_that_changes_nothing_still_streams(tokenizer):
    """transformers 5 ignores `clean_up_tokenization_spaces=True` on BPE tokenizers (and some
    releases set it when reading a GGUF): the flag alone must not send every token through
    two Python decodes."""
    flagged = load_tokenizer(resolve_packaged("smollm2-135m"), "gguf")
    flagged.clean_up_tokenization_spaces = True
    ids = flagged.encode("It is n't here , is it . Done !", add_special_tokens=False)
    if flagged.decode(ids) != tokenizer.decode(ids):
        pytest.skip("this transformers release applies the clean-up to BPE tokenizers")
    detok = IncrementalDetokenizer(flagged)
    assert detok._stream is not None
    assert "".join(streamed(detok, ids)) == flagged.decode(ids)


def test_tokens_after_a_flush_decode_afresh_on_both_paths(tokenizer):
    ids = tokenizer.encode("ok 🦀 go", add_special_tokens=False)
    pieces = []
    for tok in (tokenizer, _PythonOnly(tokenizer)):
        detok = IncrementalDetokenizer(tok)
        first = [detok.append(i) for i in ids[:3]] + [detok.flush()]
        pieces.append(first + [detok.append(i) for i in ids[3:]] + [detok.flush()])
    assert pieces[0] == pieces[1]
    assert "".join(pieces[0]).count("🦀") <= 1  # nothing held back comes out twice


def test_a_vocabulary_that_loses_the_probe_keeps_the_tokenizers_own_decode():
    """The clean-up probe says nothing when the vocabulary cannot spell it (its punctuation
    becomes unknown tokens): such a tokenizer keeps its own decode, clean-up included."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    rust = Tokenizer(models.WordLevel({"[UNK]": 0, "wait": 1, "...": 2, "ok": 3}, "[UNK]"))
    rust.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=rust, unk_token="[UNK]", clean_up_tokenization_spaces=True
    )
    ids = tok.encode("wait ... ok", add_special_tokens=False)
    assert tok.decode(ids) == "wait... ok"  # (the clean-up at work)
    detok = IncrementalDetokenizer(tok)
    assert detok._stream is None
    assert "".join(streamed(detok, ids)) == tok.decode(ids)


def test_the_stop_checker_looks_for_the_stream_once_per_tokenizer(tokenizer, monkeypatch):
    """Finding whether a tokenizer streams decodes a probe: once per engine, not per request."""
    from specserve.runtime import stop
    from specserve.runtime.request import Request
    from specserve.sampling_params import SamplingParams

    calls = []
    real = stop.stream_backend_of
    monkeypatch.setattr(stop, "stream_backend_of", lambda t: calls.append(t) or real(t))
    checker = stop.StopChecker(tokenizer, {2}, context_len=1024)
    ids = tokenizer.encode("Hello there, friend.", add_special_tokens=False)
    for i in range(3):
        req = Request(rid=str(i), prompt_ids=[1], params=SamplingParams(max_new_tokens=64), seed=0)
        checker.append_tokens(req, ids)
        assert req.text == tokenizer.decode(ids)
    assert len(calls) == 1


@pytest.mark.parametrize("skip", [True, False])
def test_text_decoded_at_the_end_is_the_streamed_text(tokenizer, skip):
    """A request whose caller reads the text only at the end is decoded in one call: it
    must give what streaming token by token would have, on both paths, for real texts, an
    incomplete character at the end and random token sequences."""
    import random

    rng = random.Random(0)
    vocab = len(tokenizer)
    cases = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    cases.append(tokenizer.encode("ok 🦀", add_special_tokens=False)[:-1])
    cases += [[rng.randrange(vocab) for _ in range(rng.randrange(1, 60))] for _ in range(20)]
    for tok in (tokenizer, _PythonOnly(tokenizer)):
        for ids in cases:
            want = "".join(streamed(IncrementalDetokenizer(tok, skip_special_tokens=skip), ids))
            assert IncrementalDetokenizer(tok, skip_special_tokens=skip).text_of(ids) == want
