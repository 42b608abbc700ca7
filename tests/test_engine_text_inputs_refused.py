"""The offline API's text inputs: a prompt or chat the tokenizer or the chat template cannot
take is refused with InvalidArgument naming the argument (not a TypeError from tokenizers or
transformers, and never silently rendered)."""

from __future__ import annotations

import pytest

from specserve import Engine, InvalidArgument

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from tests.model_factory import write_hf_model

    folder = write_hf_model(tmp_path_factory.mktemp("m"), vocab_size=101, with_tokenizer=True)
    with Engine(model_path=folder, dtype="float32", device="cpu", context_length=128) as e:
        yield e


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"messages": "hi"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [["user", "hi"]]}, "messages"),
        ({"messages": [{"content": "hi"}]}, "messages[0].role"),
        ({"messages": [*HI, {"role": 5, "content": "hi"}]}, "messages[1].role"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "a\ud800"}]}, "messages[0].content"),
        ({"add_generation_prompt": "no"}, "add_generation_prompt"),
        ({"add_generation_prompt": False, "continue_final_message": 1}, "continue_final_message"),
        ({"template_kwargs": ["enable_thinking"]}, "template_kwargs"),
        ({"template_kwargs": {"tokenize": False}}, "template_kwargs"),
        ({"template_kwargs": {"self": 1}}, "template_kwargs"),
    ],
)
def test_chat_arguments_the_template_cannot_take_are_refused_naming_them(engine, kwargs, field):
    with pytest.raises(InvalidArgument) as exc:
        engine.tokenize_chat(**{"messages": HI, **kwargs})
    assert exc.value.field == field


def test_a_well_formed_chat_still_renders(engine):
    ids = engine.tokenize_chat(HI, add_generation_prompt=True, template_kwargs={"x": 1})
    assert ids == engine.tokenize_chat(HI)


@pytest.mark.parametrize("prompt, field", [("a\ud800b", "prompt"), (["ok", "\udfff"], "prompt[1]")])
def test_a_prompt_that_is_not_unicode_text_is_refused_naming_prompt(engine, prompt, field):
    with pytest.raises(InvalidArgument, match="surrogate") as exc:
        engine.generate(prompt, {"max_new_tokens": 2})
    assert exc.value.field == field
    out = engine.generate("ok", {"max_new_tokens": 2, "ignore_eos": True})
    assert len(out["output_ids"]) == 2


def test_messages_the_chat_template_itself_refuses_are_refused_naming_messages(engine, monkeypatch):
    """A template's own raise_exception (e.g. roles that must alternate) is an error in the
    messages, not a jinja2 exception."""
    strict = (
        "{% for m in messages %}{% if m['role'] != 'user' %}"
        "{{ raise_exception('only user messages') }}{% endif %}{{ m['content'] }}{% endfor %}"
    )
    monkeypatch.setattr(engine.tokenizer, "chat_template", strict)
    with pytest.raises(InvalidArgument, match="only user messages") as exc:
        engine.tokenize_chat([{"role": "system", "content": "hi"}])
    assert exc.value.field == "messages"
