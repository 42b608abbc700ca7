"""Streamed text: token by token it adds up to the whole decode, never shows half a
character, and the Rust streaming path agrees with the rule run through `decode`."""

from __future__ import annotations

import json

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


@pytest.fixture(scope="module")
def sentencepiece_style():
    """A Llama-2 / Mistral-style tokenizer: words carry their space as a leading "\u2581",
    byte fallback, and a decoder that drops the space at the start of a sequence."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tests.model_factory import _CORPUS, _SPECIALS

    rust = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    rust.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    rust.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=list(_SPECIALS), show_progress=False
    )
    rust.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    # the 256 byte tokens of the fallback are ordinary vocabulary, as in Llama's
    spec = json.loads(rust.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    rust = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(tokenizer_object=rust, unk_token="<unk>", eos_token="</s>")


def _continuation(tok, prompt: str, answer: str) -> tuple[list[int], list[int], str]:
    """(prompt ids, the answer's ids after them, the answer's text in the whole decode)."""
    ids = tok.encode(prompt, add_special_tokens=False)
    whole = tok.encode(prompt + answer, add_special_tokens=False)
    assert whole[: len(ids)] == ids
    out = whole[len(ids) :]
    return ids, out, tok.decode(ids + out)[len(tok.decode(ids)) :]


@pytest.mark.parametrize("python_rule", [False, True])
def test_an_answer_keeps_the_space_before_its_first_word(sentencepiece_style, python_rule):
    """Decoded alone, "\u2581Paris" would lose its space ("The capital is" + "Paris."): the
    first output tokens decode after the prompt's last ones, on both paths, live and at
    the end, through the stop checker the engine uses."""
    from specserve.runtime.request import Request
    from specserve.runtime.stop import StopChecker
    from specserve.sampling_params import SamplingParams

    tok = _PythonOnly(sentencepiece_style) if python_rule else sentencepiece_style
    prompt_ids, out, want = _continuation(sentencepiece_style, "the capital is", " the dog.")
    assert want.startswith(" ") and not sentencepiece_style.decode(out).startswith(" ")
    checker = StopChecker(tok, {2}, context_len=1024)
    for stop in ([], ["zzz"]):  # (text at the end; live, as stop strings need)
        req = Request(
            rid="r",
            prompt_ids=prompt_ids,
            params=SamplingParams(max_new_tokens=64, stop=stop),
            seed=0,
        )
        req.text_at_finish = True
        checker.append_tokens(req, out)
        text = req.text if stop else req.detok.text_of(out)
        assert text == want


@pytest.mark.parametrize("skip", [True, False])
def test_text_after_a_prompt_decoded_at_the_end_is_the_streamed_text(
    tokenizer, sentencepiece_style, skip
):
    """With the prompt's tail as context, text decoded at once equals the streamed text, on
    both paths: random prompts (ending inside a character too), outputs of real text and of
    random tokens (byte tokens that are not UTF-8 too)."""
    import random

    from specserve.runtime.detokenizer import prompt_context

    rng = random.Random(1)
    words = " ".join(TEXTS).split(" ")
    for real in (tokenizer, sentencepiece_style):
        vocab = len(real)
        for tok in (real, _PythonOnly(real)):
            for _ in range(30):
                prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 12))]
                text = " ".join(rng.choice(words) for _ in range(rng.randrange(1, 12)))
                ids = real.encode(rng.choice(["", " "]) + text, add_special_tokens=False)
                if rng.random() < 0.5:
                    ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
                context = prompt_context(real, prompt, skip)
                at_end = IncrementalDetokenizer(tok, skip, context=context).text_of(ids)
                live = streamed(IncrementalDetokenizer(tok, skip, context=context), ids)
                assert at_end == "".join(live)


@pytest.mark.parametrize("skip", [True, False])
def test_stray_bytes_do_not_break_a_stream(sentencepiece_style, skip):
    """Byte-fallback tokens that are not UTF-8 make tokenizers' streaming decoder give up;
    the request's text goes on by the same rule through `decode`, piece for piece as if it
    had run that way from the start."""
    import random

    rng = random.Random(2)
    tok = sentencepiece_style
    for _ in range(40):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))]
        fast = IncrementalDetokenizer(tok, skip)
        assert fast._stream is not None
        assert streamed(fast, ids) == streamed(IncrementalDetokenizer(_PythonOnly(tok), skip), ids)
