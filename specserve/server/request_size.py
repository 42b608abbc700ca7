"""Requests too large to ever be served, rejected from their shape alone, before tokenizing.

Tokenizing runs on a small thread pool that every client shares, so a request bound to be
rejected must not get there: a body of 200,000 empty chat messages is well within the size
limit, and rendering and tokenizing it held the pool for seconds only to find the prompt too
long. Likewise a batch larger than the admission limit can never be admitted, so it is a
400 naming the field, not a 503 that asks the client to retry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from specserve.server.protocol import APIError

# Tokenizing more characters than this per context token cannot fit the context: a token
# covers at most the longest vocabulary entry; x4 leaves room for normalizers that shrink text.
CHARS_SLACK = 4
# Tokens of a message's template that its content may share (the newline before the content
# merging with its first characters, ...): taken off the measured cost of an empty message.
MERGE_MARGIN = 2


class RequestSize:
    def __init__(
        self,
        tokenizer,
        context_len: int,
        max_queued_requests: int | None,
        max_samples_per_request: int,
    ):
        self.tokenizer = tokenizer
        self.context_len = context_len
        self.max_queued_requests = max_queued_requests
        self.max_samples_per_request = max_samples_per_request
        self._longest: int | None = None
        # The fewest tokens the chat template spends on a message, whatever its content;
        # measured on the first chat request (tokenizing: off the event loop).
        self.message_tokens: int | None = None

    def check_batch(
        self, prompts: int, n: int, prompt_param: str, n_param: str, samples: int | None = None
    ) -> None:
        """A request of `prompts` prompts sampled n times each (`samples` in all where the
        prompts' n differ, n then the largest) must fit max_queued_requests on an idle server,
        and max_samples_per_request."""
        limit, name = self.max_samples_per_request, "max_samples_per_request"
        if self.max_queued_requests is not None and self.max_queued_requests < limit:
            limit, name = self.max_queued_requests, "max_queued_requests"
        if (prompts * n if samples is None else samples) <= limit:
            return
        if prompts > limit:
            raise APIError(
                f"{prompt_param}: {prompts} prompts are more than this server admits at once "
                f"({name}={limit}); send at most {limit} prompts per request",
                param=prompt_param,
            )
        if samples is not None and samples != prompts * n:  # (each prompt's own n)
            raise APIError(
                f"{n_param}: the {prompts} prompts' n add up to {samples} requests, more than "
                f"this server admits at once ({name}={limit}); their n may add up to at most "
                f"{limit}",
                param=n_param,
            )
        raise APIError(
            f"{n_param}: {prompts} prompt(s) sampled n={n} times are {prompts * n} requests, "
            f"more than this server admits at once ({name}={limit}); with "
            f"{prompts} prompt(s) n can be at most {limit // prompts}",
            param=n_param,
        )

    def _longest_token(self) -> int:
        """Characters of the longest vocabulary entry (the vocabulary read once)."""
        if self._longest is None:
            vocab = self.tokenizer.get_vocab()
            self._longest = max(1, max((len(t) for t in vocab), default=1))
        return self._longest

    def max_chars(self) -> int:
        """Characters beyond which a text cannot fit the context, whatever it says."""
        return self.context_len * self._longest_token() * CHARS_SLACK

    def check_text(self, chars: int, param: str) -> None:
        if chars > self.max_chars():
            raise APIError(
                f"{param}: the prompt has {chars} characters, more than a context of "
                f"{self.context_len} tokens can hold (the prompt must be shorter)",
                param=param,
            )

    def measure_message_tokens(self, tokenize_chat: Callable[[list[dict]], list[int]]) -> int:
        """The fewest tokens the chat template adds for one more empty message (an assistant
        turn after a user one; a user or system one after that, where the template takes it),
        less MERGE_MARGIN; at least 1, which every template's role markers cost."""

        def empty(role: str) -> dict[str, str]:
            return {"role": role, "content": ""}

        turn = [empty("user"), empty("assistant")]
        costs = []
        try:
            two = len(tokenize_chat(turn))
            costs.append(two - len(tokenize_chat(turn[:1])))
            for role in ("user", "system"):
                try:
                    costs.append(len(tokenize_chat([*turn, empty(role)])) - two)
                except Exception:  # a template may refuse the role there (strict alternation)
                    pass
        except Exception:  # no template, or one that refuses this turn: assume the least
            pass
        self.message_tokens = max(1, min(costs, default=1) - MERGE_MARGIN)
        return self.message_tokens

    def check_chat(self, messages: list[dict[str, Any]]) -> None:
        """Reject messages whose template and content cannot fit the context (a lower bound
        on their tokens; call measure_message_tokens first)."""
        per_message = self.message_tokens or 1
        chars = sum(len(m["content"]) for m in messages)
        least = len(messages) * per_message + chars // (self._longest_token() * CHARS_SLACK)
        if least >= self.context_len:
            raise APIError(
                f"messages: {len(messages)} messages with {chars} characters of content take "
                f"at least {least} tokens with the chat template ({per_message} or more per "
                f"message), and the model's context length is {self.context_len} (the prompt "
                "must be shorter)",
                param="messages",
            )
