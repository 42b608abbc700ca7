"""The reduced vocabulary an EAGLE head drafts in (`--speculative-token-map`), optionally
growing with the tokens of the requests being served (`--speculative-token-map-growth`).

A token map covers most of what the target writes, but not the words a request brings along:
names and rare nouns of its prompt, which the answer copies and the draft predicts well.
Measured on SmolLM2-135M (32 held-out chats, 128 greedy tokens each): 4.2% of the answer
tokens are outside a 16,384-token map, 2.5% outside the map plus the prompt, 1.4% outside the
map, the prompt and the answer's earlier tokens. So with room for `growth` more columns, the
prompt and output tokens of every running request that the map lacks get a column while a
request that brought them runs (first come, first served while the room lasts); a column is
freed when the last request holding its token finishes.

Device layout, fixed at construction so CUDA graphs keep reading the same buffers: `weight`
[map + growth, hidden] (rows of the target's lm_head), `ids` [map + growth] (the target id of
each column, all distinct: a free column holds a token outside the vocabulary, since where
penalties leave fewer than topk finite columns the draft's top-k takes free ones too, and two
siblings of one token would both be accepted) and `bias` (0 for a column in use, -inf for a
free one, so that free columns rank last and take no probability mass). Changes are
stream-ordered device writes issued between steps: a step already launched drafts with the
vocabulary it was launched with.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from specserve.device import to_device


class DraftVocab:
    def __init__(self, lm_head: torch.Tensor, token_ids: torch.Tensor, growth: int = 0):
        if growth < 0:
            raise ValueError(f"growth must be >= 0, got {growth}")
        self._full = lm_head  # the target's [vocab, hidden] (shared, never written)
        dev = lm_head.device
        token_ids = token_ids.to(device=dev, dtype=torch.int64).contiguous()
        self.base = token_ids.numel()
        self.capacity = self.base + growth
        self.weight = torch.zeros(
            (self.capacity, lm_head.shape[1]), dtype=lm_head.dtype, device=dev
        )
        self.weight[: self.base] = lm_head[token_ids]
        outside = torch.ones(lm_head.shape[0], dtype=torch.bool, device=dev)
        outside[token_ids] = False
        spare = outside.nonzero().flatten()[:growth]
        if spare.numel() < growth:
            raise ValueError(f"growth {growth} exceeds the {spare.numel()} tokens outside the map")
        self.ids = torch.cat([token_ids, spare])
        self._ids = self.ids.tolist()  # host copy
        # a free column's token (outside the vocabulary) -> that column
        self._spare = {t: self.base + i for i, t in enumerate(spare.tolist())}
        self.bias = None
        if growth:
            self.bias = torch.full((self.capacity,), float("-inf"), dtype=lm_head.dtype, device=dev)
            self.bias[: self.base] = 0
        self._map = frozenset(token_ids.tolist())
        self._free = list(range(self.capacity - 1, self.base - 1, -1))  # pop() -> lowest column
        self._column: dict[int, int] = {}  # added token -> its column
        self._holders: dict[int, int] = {}  # added token -> how many owners hold it
        self._owned: dict[str, set[int]] = {}  # owner (request id) -> tokens it holds

    @property
    def grows(self) -> bool:
        return self.bias is not None

    @property
    def size(self) -> int:
        """Columns in use: the map plus the added tokens."""
        return self.base + len(self._column)

    def __contains__(self, token: int) -> bool:
        return token in self._map or token in self._column

    # The mutators run in inference mode: an Engine built inside torch.inference_mode() holds
    # these buffers as inference tensors, which the loop thread could not write in place.
    def add(self, tokens_by_owner: Mapping[str, Sequence[int]]) -> int:
        """Each owner's tokens join the vocabulary while room lasts (one device update for
        all of them); returns how many columns were taken."""
        if self.bias is None:
            return 0
        # (one set over the whole step first, in C: nearly every token a decode step emits is
        # in the map, so most steps stop here and most owners are never looked at; this runs
        # for every step, and at a batch of 128 of a small model the host sets its pace)
        outside = set().union(*tokens_by_owner.values())
        outside -= self._map
        if not outside:
            return 0
        new: list[int] = []
        moved: dict[int, int] = {}  # free column -> the spare token it holds now
        for owner, tokens in tokens_by_owner.items():
            if outside.isdisjoint(tokens):
                continue
            held = self._owned.setdefault(owner, set())
            fresh = set(tokens)
            fresh -= held
            fresh -= self._map
            if not fresh:
                continue
            for t in tokens:  # (in order: the first tokens take the room left)
                if t not in fresh or t in held:
                    continue
                if t in self._column:
                    self._holders[t] += 1
                elif self._free:
                    col = self._free.pop()
                    self._take_spare(col, t, moved)
                    self._column[t] = col
                    self._holders[t] = 1
                    new.append(t)
                else:
                    continue  # no room: the token stays undraftable
                held.add(t)
        if new:
            self._write_columns(new, moved)
        return len(new)

    def _take_spare(self, col: int, token: int, moved: dict[int, int]) -> None:
        """Free column `col` is about to hold `token`: its spare token goes to the free
        column that held `token` as its spare, if any (ids stay distinct)."""
        spare = self._ids[col]
        del self._spare[spare]
        other = self._spare.pop(token, None)
        if other is not None:
            self._spare[spare] = other
            self._ids[other] = spare
            moved[other] = spare
        self._ids[col] = token
        moved.pop(col, None)

    @torch.inference_mode()
    def _write_columns(self, new: list[int], moved: dict[int, int]) -> None:
        """The added tokens' columns on the device: weight rows, ids, bias 0; and the free
        columns whose spare token changed."""
        n = len(new)
        # one pinned host->device copy of [columns; tokens], the added ones first, then the
        # moved spares: at a batch of 64 some request brings a new token nearly every step,
        # and a staged copy costs the host about as much as the set work in `add`
        host = torch.tensor(
            [[self._column[t] for t in new] + list(moved), new + list(moved.values())],
            dtype=torch.int64,
        )
        cols, ids = to_device(host, self.weight.device)
        self.weight.index_copy_(0, cols[:n], self._full.index_select(0, ids[:n]))
        self.ids.index_copy_(0, cols, ids)  # (the added and moved columns are distinct)
        self.bias.index_fill_(0, cols[:n], 0)

    @torch.inference_mode()
    def release(self, owners: Iterable[str]) -> None:
        """These owners are done: free the columns of tokens nobody else holds."""
        freed = []
        for owner in owners:
            for t in self._owned.pop(owner, ()):
                self._holders[t] -= 1
                if self._holders[t] == 0:
                    del self._holders[t]
                    col = self._column.pop(t)
                    self._free.append(col)
                    self._spare[t] = col  # t has left the vocabulary: the column's spare
                    freed.append(col)
        if freed:
            cols = to_device(torch.tensor(freed), self.bias.device)
            self.bias.index_fill_(0, cols, float("-inf"))
