"""Tokenizers and chat templates, through transformers."""

from __future__ import annotations

import inspect
import logging
import os

from specserve.errors import InvalidArgument
from specserve.model.gguf_loader import gguf_architecture, gguf_chat_template
from specserve.model.hf_loader import read_json_object

log = logging.getLogger(__name__)


def load_tokenizer(source: str, kind: str):
    """kind: 'gguf' (a .gguf file) or 'hf' (a folder with tokenizer files)."""
    try:
        return _load_tokenizer(source, kind)
    except Exception as e:
        if type(e) is not Exception:
            raise
        # the tokenizers binding raises a bare Exception on an inconsistent vocabulary (a
        # merge of a token it lacks): a malformed file like any other
        raise ValueError(str(e)) from e


def _load_tokenizer(source: str, kind: str):
    from transformers import AutoTokenizer

    if kind == "gguf":
        folder, name = os.path.dirname(os.path.abspath(source)), os.path.basename(source)
        tok = _gguf_tokenizer_direct(source, folder, name)
        if tok is None:
            tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        if not getattr(tok, "chat_template", None):
            tok.chat_template = gguf_chat_template(source)
        return tok
    config = os.path.join(source, "tokenizer_config.json")
    if os.path.isfile(config):
        read_json_object(config)  # (transformers calls .get on it: an AttributeError otherwise)
    return AutoTokenizer.from_pretrained(source)


def _gguf_tokenizer_direct(source: str, folder: str, name: str):
    """The tokenizer class AutoTokenizer would pick for this GGUF, loaded directly.

    AutoTokenizer with `gguf_file` first builds the whole model config from the file with
    transformers' legacy GGUF reader (seconds for a 49k vocabulary) only to choose the class
    from `model_type`; the tokenizer itself is built from the file's metadata by the class.
    Same class, same result, without that detour. Returns None when AutoTokenizer would
    decide from something else (a tokenizer_config.json next to the file) or on any failure.
    """
    if os.path.isfile(os.path.join(folder, "tokenizer_config.json")):
        return None
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.models.auto.tokenization_auto import (
            TOKENIZER_MAPPING_NAMES,
            tokenizer_class_from_name,
        )

        class_name = TOKENIZER_MAPPING_NAMES.get(gguf_architecture(source) or "")
        cls = tokenizer_class_from_name(class_name) if class_name else None
        return (cls or PreTrainedTokenizerFast).from_pretrained(folder, gguf_file=name)
    except Exception as e:  # fall back to the general path
        log.debug("direct GGUF tokenizer load failed (%s); using AutoTokenizer", e)
        return None


def tokenizer_files(folder: str) -> list[str]:
    names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
    return [n for n in names if os.path.isfile(os.path.join(folder, n))]


def has_tokenizer_files(folder: str) -> bool:
    return bool(tokenizer_files(folder))


def apply_chat_template(
    tokenizer,
    messages: list[dict],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict | None = None,
) -> list[int]:
    """The token ids of `messages` through the model's chat template: ending with the
    assistant's turn opened (add_generation_prompt), or with the final message left open for
    the model to continue (continue_final_message); template_kwargs: extra variables the
    template reads (e.g. `enable_thinking`)."""
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer (the engine was started with skip_tokenizer_init)")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model's tokenizer has no chat template")
    from jinja2 import TemplateError

    try:
        out = tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=True,
            **(template_kwargs or {}),
        )
    except TemplateError as e:  # (the template's own raise_exception: roles out of order, ...)
        raise ValueError(f"the chat template refused them: {e}") from None
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return list(out)


def check_text(field: str, text: str) -> None:
    """Text a tokenizer can encode: a Python string may hold lone surrogates, which are no
    Unicode text (tokenizers raises a TypeError on them)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidArgument(
            field, f"is not valid Unicode text: lone surrogate {text[e.start]!r} at index {e.start}"
        ) from None


def check_chat_arguments(
    tokenizer, messages, add_generation_prompt, continue_final_message, template_kwargs
) -> None:
    """`apply_chat_template`'s arguments, refused naming the one at fault where the template
    would raise a TypeError on it or take it silently (a flag that is not a bool renders as
    its truth value, content that is not a string as its repr)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("messages", "must be a non-empty list of {'role', 'content'} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidArgument("messages", f"must hold {{'role', 'content'}} dicts, got {m!r}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise InvalidArgument(
                    f"messages[{i}].{key}", f"must be a string, got {type(m.get(key)).__name__}"
                )
        check_text(f"messages[{i}].content", m["content"])
    for name, flag in (
        ("add_generation_prompt", add_generation_prompt),
        ("continue_final_message", continue_final_message),
    ):
        if not isinstance(flag, bool):
            raise InvalidArgument(name, f"must be true or false, got {flag!r}")
    if template_kwargs is None:
        return
    if not isinstance(template_kwargs, dict):
        raise InvalidArgument("template_kwargs", "must be a dict of template variables or None")
    own = inspect.signature(tokenizer.apply_chat_template).parameters
    # ('self' too: a bound method's signature leaves it out, but the call binds it)
    taken = sorted(
        k
        for k in template_kwargs
        if k == "self" or (k in own and own[k].kind != own[k].VAR_KEYWORD)
    )
    if taken:
        raise InvalidArgument(
            "template_kwargs",
            f"{', '.join(taken)}: apply_chat_template's own argument, not a template variable",
        )
