"""Per-request state that lives on the device, one row per request holding KV pages.

- `pages[row, i]`: the i-th page of the request, mirrored from `KVTable` (the host stays
  the owner; the mirror is written in one batched update per step by `flush`).
- `kv_lens[row]`, `roots[row]`: the next decode step's inputs (exact KV length and the
  last sampled token), written by prefill and by every decode step on the device.
- `features[row]`: the draft's state for the root (EAGLE), when a drafter is attached.
- `draft_lens[row]` and the lag ring (load-adaptive speculation): the draft's KV is exact for
  positions < draft_lens[row]; the decode steps that skipped the draft left, at ring index
  q % lag_capacity, the token after position q and the target's features at q, so the draft
  can catch up on them later in one pass (speculative/drafter.py `catch_up`).
- `sampling_floats[:, row]` (temperature, top_p, min_p) and `sampling_ints[:, row]` (top_k,
  seed, decoded plainly): the request's sampling parameters, written by the first step of a
  batch whose row does not hold them (tagged by the writer; a released row holds none): its
  first step in the row, after a retraction, when it stops speculating. A decode step
  gathers its batch's by row, inside its CUDA graph, so a batch whose membership changed
  (every step of a large batch's tail, or of a server whose requests come and go) builds and
  copies no sampling tensors.
- `reached[row, d]`, `predicted[row, d]` (ragged verification): how often the request's
  accepted path reached depth d, and the draft's best path probability there, moving
  averages that calibrate its share of a step's verified nodes (speculative/verify_budget.py).

A decode step then needs only the rows of its requests from the host: it reads and writes
everything else by row, on the device, so it can be launched before the host has seen the
previous step and can be replayed from a CUDA graph. Writes are stream-ordered after every
launched step, so a row freed by one request and reused by another is never seen mixed.

Row 0 is never handed out: it is the padding row of a padded (graph) batch; its pages are
all the scratch page 0, so padded tokens read and write only scratch slots.
"""

from __future__ import annotations

from itertools import repeat

import numpy as np
import torch

from specserve.device import to_device

PAD_ROW = 0
# what padding rows sample with: greedily, no filters (their outputs are discarded)
PAD_SAMPLING_FLOATS = (0.0, 1.0, 0.0)  # temperature, top_p, min_p
PAD_SAMPLING_INTS = (0, 0, 0)  # top_k, seed, decoded plainly


class RequestRows:
    def __init__(self, device: torch.device, page_size: int, max_pages: int, rows: int = 64):
        self.device = device
        self.page_size = page_size
        self._row_of: dict[str, int] = {}
        # row -> the caller's tag of the sampling parameters written there (`set_sampling`);
        # dropped when the row is released, so its next holder's are always written
        self._sampling_tags: dict[int, object] = {}
        # page updates since the last flush, in order: (row, page index) -> page id, the
        # latest write of a (row, index) winning
        self._pending_rows: list[int] = []
        self._pending_index: list[int] = []
        self._pending_pages: list[int] = []
        self._feature_spec: tuple[int, torch.dtype] | None = None
        self._ring_spec: tuple[int, int, torch.dtype] | None = None  # (capacity, dim, dtype)
        self.draft_lens = self.ring_tokens = self.ring_features = None
        self._calibration_depths = 0  # depths 0..D tracked per row (0: none)
        self.reached = self.predicted = None
        self.version = 0  # bumped when tensors are reallocated (captured graphs go stale)
        # bumped when an attached table is added or reallocates its own tensors: only graphs
        # that read attached tables (penalized steps) go stale
        self.attached_version = 0
        self._attached: list = []  # more per-row tables (`attach`)
        self._allocate(max(rows, 2), max(max_pages, 1))
        self._free = list(range(self.num_rows - 1, PAD_ROW, -1))

    # ---- storage ------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return self.pages.shape[0]

    def _allocate(self, rows: int, max_pages: int) -> None:
        old = getattr(self, "pages", None)
        dev = self.device
        pages = torch.zeros(rows, max_pages, dtype=torch.int32, device=dev)
        kv_lens = torch.zeros(rows, dtype=torch.int64, device=dev)
        roots = torch.zeros(rows, dtype=torch.int64, device=dev)
        features = None
        if self._feature_spec is not None:
            dim, dtype = self._feature_spec
            features = torch.zeros(rows, dim, dtype=dtype, device=dev)
        ring = self._new_ring(rows)
        calibration = self._new_calibration(rows)
        # (filled on the device: a tensor built from host values would be a pageable copy,
        # which waits for the step in flight, and this can run while one is)
        floats = torch.empty((3, rows), dtype=torch.float32, device=dev)
        ints = torch.empty((3, rows), dtype=torch.int64, device=dev)
        for table, pad in ((floats, PAD_SAMPLING_FLOATS), (ints, PAD_SAMPLING_INTS)):
            for i, value in enumerate(pad):
                table[i].fill_(value)
        if old is not None:  # keep what is there (a device copy, ordered after launched work)
            r, p = old.shape
            pages[:r, :p] = old
            kv_lens[:r] = self.kv_lens
            roots[:r] = self.roots
            floats[:, :r] = self.sampling_floats
            ints[:, :r] = self.sampling_ints
            if features is not None and self.features is not None:
                features[:r] = self.features
            if ring is not None and self.draft_lens is not None:
                for new, cur in zip(ring, (self.draft_lens, self.ring_tokens, self.ring_features)):
                    new[:r] = cur
            if calibration is not None and self.reached is not None:
                calibration[0][:r], calibration[1][:r] = self.reached, self.predicted
            for table in self._attached:
                table.resize(rows)
            self.version += 1
        self.pages, self.kv_lens, self.roots, self.features = pages, kv_lens, roots, features
        self.sampling_floats, self.sampling_ints = floats, ints
        if ring is not None:
            self.draft_lens, self.ring_tokens, self.ring_features = ring
        if calibration is not None:
            self.reached, self.predicted = calibration

    def _new_calibration(self, rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self._calibration_depths:
            return None
        shape = (rows, self._calibration_depths + 1)
        return (
            torch.ones(shape, dtype=torch.float32, device=self.device),
            torch.ones(shape, dtype=torch.float32, device=self.device),
        )

    def add_calibration(self, max_depth: int) -> None:
        """Track acceptance per depth 0..max_depth for every row (ragged verification)."""
        self._calibration_depths = max_depth
        self.reached, self.predicted = self._new_calibration(self.num_rows)
        self.version += 1

    def reset_calibration(self, rows: torch.Tensor) -> None:
        """A new request in these rows starts from no evidence (reached = predicted)."""
        if self.reached is not None:
            self.reached[rows] = 1.0
            self.predicted[rows] = 1.0

    def _new_ring(self, rows: int) -> tuple[torch.Tensor, ...] | None:
        if self._ring_spec is None:
            return None
        capacity, dim, dtype = self._ring_spec
        dev = self.device
        return (
            torch.zeros(rows, dtype=torch.int64, device=dev),
            torch.zeros(rows, capacity, dtype=torch.int64, device=dev),
            torch.zeros(rows, capacity, max(dim, 1), dtype=dtype, device=dev),
        )

    def add_features(self, dim: int, dtype: torch.dtype) -> None:
        """Give every row a draft feature vector of `dim` (called once, when a drafter attaches)."""
        self._feature_spec = (dim, dtype)
        self.features = torch.zeros(self.num_rows, dim, dtype=dtype, device=self.device)
        self.version += 1

    def add_lag_ring(self, capacity: int, dim: int, dtype: torch.dtype) -> None:
        """Let decode steps skip the draft for up to `capacity` tokens per request (called
        once, when load-adaptive speculation is on); dim: the target features the draft reads
        per position (0: none)."""
        self._ring_spec = (capacity, dim, dtype)
        self.draft_lens, self.ring_tokens, self.ring_features = self._new_ring(self.num_rows)
        self.version += 1

    def attach(self, table) -> None:
        """Another per-row table, kept beside these: `table.resize(rows)` when rows are
        reallocated (keeping what rows hold), `table.forget(row)` when a row is released."""
        table.resize(self.num_rows)
        self._attached.append(table)
        self.attached_version += 1

    def tables_changed(self) -> None:
        """An attached table reallocated its tensors (graphs that read it read the old ones;
        this table's own tensors did not move)."""
        self.attached_version += 1

    @property
    def lag_capacity(self) -> int:
        return 0 if self._ring_spec is None else self._ring_spec[0]

    # ---- mirroring the host page table --------------------------------------------------------
    def row(self, rid: str) -> int:
        return self._row_of[rid]

    def rows_of(self, rids: list[str]) -> list[int]:
        return [self._row_of[r] for r in rids]

    def on_pages_added(self, rid: str, first_index: int, pages: list[int]) -> None:
        row = self._row_of.get(rid)
        if row is None:
            if not self._free:
                self._allocate(self.num_rows * 2, self.pages.shape[1])
                self._free = list(range(self.num_rows - 1, self.num_rows // 2 - 1, -1))
            row = self._free.pop()
            self._row_of[rid] = row
        end = first_index + len(pages)
        if end > self.pages.shape[1]:
            self._allocate(self.num_rows, max(end, 2 * self.pages.shape[1]))
        self._pending_rows.extend(repeat(row, len(pages)))
        self._pending_index.extend(range(first_index, end))
        self._pending_pages.extend(pages)

    def on_release(self, rid: str) -> None:
        row = self._row_of.pop(rid, None)
        if row is not None:
            self._sampling_tags.pop(row, None)
            for table in self._attached:
                table.forget(row)
            self._free.append(row)

    def flush(self) -> None:
        """Apply the page updates since the last flush (one host->device copy)."""
        if not self._pending_pages:
            return
        # (numpy in C: a chat turn's prompt brings a page per token at page size 1, tens of
        # thousands in one prefill, and a decode step a few per request)
        upd = np.array([self._pending_rows, self._pending_index, self._pending_pages], np.int64)
        self._pending_rows, self._pending_index, self._pending_pages = [], [], []
        # a (row, index) written twice (truncated, then given a new page) keeps its latest
        # page: the first of each in reverse order (an index_put with repeated indices would
        # pick any)
        keys = upd[0] * self.pages.shape[1] + upd[1]
        _, last = np.unique(keys[::-1], return_index=True)
        if len(last) < len(keys):
            upd = upd[:, len(keys) - 1 - last]
        host = torch.from_numpy(np.ascontiguousarray(upd))  # [3, N]
        upd = to_device(host, self.device)
        self.pages[upd[0], upd[1]] = upd[2].to(torch.int32)

    # ---- sampling parameters by row ------------------------------------------------------------
    def sampling_tag(self, row: int) -> object | None:
        """The tag `set_sampling` last wrote with at this row, while the row is held."""
        return self._sampling_tags.get(row)

    # (in inference mode: an engine built inside torch.inference_mode() holds these tables as
    # inference tensors, and the adaptive policy's graph lookup asks for a batch's sampling
    # before the step is launched, outside it)
    @torch.inference_mode()
    def set_sampling(
        self,
        rows: list[int],
        floats: list[tuple[float, float, float]],
        ints: list[tuple],
        tags: list[object],
    ) -> None:
        """Rows' sampling parameters: (temperature, top_p, min_p) and (top_k, seed, decoded
        plainly) each, and what the caller knows them by (`sampling_tag`); three host->device
        copies for the lot (rows, floats, ints), ordered after launched steps."""
        if not rows:
            return
        self._sampling_tags.update(zip(rows, tags))
        idx = to_device(torch.tensor(rows, dtype=torch.int64), self.device)
        f = to_device(torch.tensor(floats, dtype=torch.float32).T.contiguous(), self.device)
        i = to_device(torch.tensor(ints, dtype=torch.int64).T.contiguous(), self.device)
        self.sampling_floats[:, idx] = f
        self.sampling_ints[:, idx] = i

    # ---- device-side reads and writes (no host values needed) ---------------------------------
    def slots(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """[B, width] int64 slots of logical positions 0..width-1 of each row's request
        (positions past a request's pages hold stale slots: callers never read them)."""
        pos = torch.arange(width, device=rows.device)
        ps = self.page_size
        page_idx = (pos // ps).clamp(max=self.pages.shape[1] - 1)
        pages = self.pages[rows[:, None], page_idx[None, :]].to(torch.int64)  # [B, width]
        return pages * ps + pos % ps if ps > 1 else pages

    def set_state(
        self,
        rows: torch.Tensor,
        kv_lens: torch.Tensor,
        roots: torch.Tensor,
        features: torch.Tensor | None = None,
        draft_lens: torch.Tensor | None = None,
    ) -> None:
        """draft_lens: where the draft is now exact up to (None: unchanged)."""
        self.kv_lens[rows] = kv_lens
        self.roots[rows] = roots
        if features is not None:
            self.features[rows] = features.to(self.features.dtype)
        if draft_lens is not None and self.draft_lens is not None:
            self.draft_lens[rows] = draft_lens
