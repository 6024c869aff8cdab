"""The training step as CUDA graphs over fixed-capacity token buckets (``model.cuda_graphs``).

:func:`token_capacities` picks a few token capacities from the planned batches; :class:`StaticBatch`
pads a batch to its bucket with one extra sequence that no real example reads;
:class:`GraphedTrainStep` captures forward, loss and gradients once per bucket and replays them.
Why each piece is as it is: docs/training.md#cuda-graphs."""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Callable

import numpy as np
import torch

log = logging.getLogger(__name__)

LossFn = Callable[[dict, torch.Tensor], torch.Tensor]  # (model inputs, labels [B]) -> loss
_ROUND = 256  # capacities are multiples of this many rows


def token_capacities(counts: np.ndarray, buckets: int, round_to: int = _ROUND) -> list[int]:
    """At most `buckets` capacities (ascending, multiples of `round_to`) covering every count,
    chosen to minimise the total padding sum(capacity - count) over `counts`.

    An exact dynamic programme over the distinct rounded-up counts: the optimal capacities are
    among them, and each bucket's capacity is the largest count it holds."""
    counts = np.asarray(counts, dtype=np.int64)
    if counts.size == 0 or buckets < 1:
        raise ValueError("token_capacities needs at least one count and one bucket")
    rounded = -(-np.maximum(counts, 1) // round_to) * round_to
    values, freq = np.unique(rounded, return_counts=True)  # ascending
    n, k = len(values), min(buckets, len(values))
    # cost(i, j): padding of the counts with rounded values in values[i..j] under capacity values[j]
    cum_n = np.concatenate([[0], np.cumsum(freq)])
    cum_s = np.concatenate([[0], np.cumsum(freq * values)])

    def cost(i: int, j: int) -> float:
        m = cum_n[j + 1] - cum_n[i]
        return float(values[j] * m - (cum_s[j + 1] - cum_s[i]))

    inf = math.inf
    best = [[inf] * n for _ in range(k + 1)]  # best[b][j]: values[0..j] in b buckets, last ends at j
    cut = [[-1] * n for _ in range(k + 1)]
    for j in range(n):
        best[1][j] = cost(0, j)
    for b in range(2, k + 1):
        for j in range(b - 1, n):
            for i in range(b - 1, j + 1):  # the last bucket holds values[i..j]
                c = best[b - 1][i - 1] + cost(i, j)
                if c < best[b][j]:
                    best[b][j], cut[b][j] = c, i
    b = min(range(1, k + 1), key=lambda m: best[m][n - 1])
    caps, j = [], n - 1
    while b >= 1 and j >= 0:
        caps.append(int(values[j]))
        j = cut[b][j] - 1 if b > 1 else -1
        b -= 1
    return sorted(caps)


class StaticBatch:
    """Fixed-shape, fixed-address inputs of one token bucket (on one device).

    ``B + 1`` sequences: rows ``offsets[b] .. offsets[b+1]`` of the B real ones come from the
    batch; the last sequence owns the rows ``T .. capacity-1`` (whatever an earlier batch left
    there: valid ids, never read by a real example). ``label`` is ``[B]``: the extra example has
    none and is dropped from the loss."""

    def __init__(self, capacity: int, batch_size: int, n_dense: int, max_seq_len: int,
                 device: torch.device):
        self.capacity, self.batch_size, self.max_seq_len = int(capacity), int(batch_size), int(max_seq_len)
        B1 = self.batch_size + 1

        def zeros(*shape, dtype):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.hist_item = zeros(self.capacity, dtype=torch.int32)  # dtypes of pipeline.batches
        self.hist_action = zeros(self.capacity, dtype=torch.int8)
        self.hist_age = zeros(self.capacity, dtype=torch.float32)
        self.offsets = zeros(B1 + 1, dtype=torch.int64)
        self.offsets[-1] = self.capacity  # every row in the extra sequence until the first fill
        self.cand_item = zeros(B1, dtype=torch.int32)
        self.dense = zeros(B1, n_dense, dtype=torch.float32)
        self.label = zeros(self.batch_size, dtype=torch.float32)

    def fits(self, batch: dict) -> bool:
        return int(batch["label"].shape[0]) == self.batch_size and int(batch["n_tokens"]) <= self.capacity

    def fill(self, batch: dict) -> None:
        """Copy a batch in (device to device, asynchronous); rows past its T keep old values."""
        T, B = int(batch["n_tokens"]), self.batch_size
        if not self.fits(batch):
            raise ValueError(f"a batch of {batch['label'].shape[0]} examples and {T} items does not fit "
                             f"a bucket of {B} examples and {self.capacity} items")
        self.hist_item[:T].copy_(batch["hist_item"], non_blocking=True)
        self.hist_action[:T].copy_(batch["hist_action"], non_blocking=True)
        self.hist_age[:T].copy_(batch["hist_age"], non_blocking=True)
        self.offsets[: B + 1].copy_(batch["offsets"], non_blocking=True)
        self.cand_item[:B].copy_(batch["cand_item"], non_blocking=True)
        self.dense[:B].copy_(batch["dense"], non_blocking=True)
        self.label.copy_(batch["label"], non_blocking=True)

    def inputs(self) -> dict:
        """The model's keyword arguments (B + 1 sequences)."""
        return {"hist_item": self.hist_item, "hist_action": self.hist_action, "hist_age": self.hist_age,
                "offsets": self.offsets, "max_seq_len": self.max_seq_len, "cand_item": self.cand_item,
                "dense": self.dense}


def model_inputs(batch: dict) -> dict:
    keys = ("hist_item", "hist_action", "hist_age", "offsets", "max_seq_len", "cand_item", "dense")
    return {k: batch[k] for k in keys}


def loss_and_grads(loss_fn: LossFn, inputs: dict, label: torch.Tensor, params: list[torch.Tensor],
                   autocast_dtype: torch.dtype | None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Forward (under autocast when a dtype is given) and the parameters' gradients."""
    amp = (torch.autocast(label.device.type, dtype=autocast_dtype, cache_enabled=False)  # no cast cache
           if autocast_dtype is not None else contextlib.nullcontext())  # kept across a capture
    with amp:
        loss = loss_fn(inputs, label)
    grads = torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True)
    return loss.detach(), grads


class GraphedTrainStep:
    """Forward, loss and gradients of a training step as CUDA graph replays (see module doc).

    Args:
        loss_fn: ``(model inputs, labels [B]) -> scalar loss``; it must use only the first
            ``len(labels)`` logits (the extra padding example has no label).
        params: the parameters to differentiate (their ``.grad`` are set to the shared buffers).
        capacities: token capacities of the buckets (ascending).
        autocast_dtype: torch.bfloat16 for bf16-mixed training, None for full precision.
        lookup: the sharded table's pipeline.table.GraphedLookup (each bucket's ids planned by a
            graph of their own, their rows an input of the step's graph, exchanged eagerly between
            the two replays and after; the table not among `params`), or None."""

    def __init__(self, loss_fn: LossFn, params: list[torch.Tensor], capacities: list[int], batch_size: int,
                 n_dense: int, max_seq_len: int, device: torch.device, autocast_dtype: torch.dtype | None,
                 lookup=None):
        if device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.loss_fn, self.params, self.autocast_dtype = loss_fn, list(params), autocast_dtype
        self.capacities = sorted(int(c) for c in capacities)
        self.lookup = lookup
        self.statics = [StaticBatch(c, batch_size, n_dense, max_seq_len, device) for c in self.capacities]
        self.plans: list[tuple] = [()] * len(self.capacities)  # with a lookup: (graph, message, slots)
        self.rows_grads: list[torch.Tensor | None] = [None] * len(self.capacities)  # the gradient of lookup.got
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.losses: list[torch.Tensor] = []
        self.grads: tuple[torch.Tensor, ...] | None = None
        self.fallbacks = 0  # batches that ran eagerly (above the largest capacity)
        self.replays = [0] * len(self.capacities)
        self.sparse: list[dict[int, torch.Tensor]] = [{} for _ in self.capacities]  # per bucket: _take

    def capture(self) -> None:
        """Warm up (compiles every kernel variant) and capture one graph per bucket, largest first."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        order = sorted(range(len(self.statics)), key=lambda i: -self.capacities[i])
        graphs: dict[int, torch.cuda.CUDAGraph] = {}
        losses: dict[int, torch.Tensor] = {}
        # Every warm-up before the first capture: a warm-up runs outside the graphs' pool, and
        # next to a captured graph's memory it would need a second copy of the activations.
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # lazy initialisation on the capturing stream
            for i in order:
                self._loss_and_grads(i, self._plan(i))
        torch.cuda.current_stream().wait_stream(stream)
        for i in order:
            plan = None
            if self.lookup is not None:
                self.plans[i] = (torch.cuda.CUDAGraph(),)
                with torch.cuda.graph(self.plans[i][0], pool=pool, stream=stream, capture_error_mode="thread_local"):
                    plan = self._plan(i)
                self.plans[i] += plan
            graph = torch.cuda.CUDAGraph()
            # thread_local: the loader's pinning thread may allocate pinned memory meanwhile
            with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                loss, grads = self._loss_and_grads(i, plan)
                if self.grads is None:
                    self.grads = grads  # the largest bucket's gradients are the .grad buffers
                self.sparse[i] = self._take(grads)
            graphs[i], losses[i] = graph, loss
        self.graphs = [graphs[i] for i in range(len(self.statics))]
        self.losses = [losses[i] for i in range(len(self.statics))]
        self._bind_grads()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the warm-up's blocks outside the graphs' pool

    def _plan(self, i: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The lookup's message and slots of bucket `i`'s ids (its padding masked), or None."""
        static = self.statics[i]
        limits = (static.offsets[static.batch_size], static.batch_size)  # a device scalar: no sync
        return None if self.lookup is None else self.lookup.plan([static.hist_item, static.cand_item], limits)

    def _loss_and_grads(self, i: int, plan) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        static, extra = self.statics[i], [] if plan is None else [self.lookup.got]
        rows = None if plan is None else self.lookup.got.index_select(0, plan[1])  # backward: index_add_ (atomic)
        inputs = static.inputs() if rows is None else {**static.inputs(), "item_rows": rows}
        loss, grads = loss_and_grads(self.loss_fn, inputs, static.label, self.params + extra, self.autocast_dtype)
        if extra:
            self.rows_grads[i], grads = grads[-1], grads[:-1]
        return loss, grads

    def _take(self, grads: tuple[torch.Tensor, ...]) -> dict[int, torch.Tensor]:
        """The dense ones of `grads` copied into the .grad buffers; the sparse ones (a sparse item
        table's, of its bucket's size) returned by parameter index, bound as they are."""
        sparse = {k: g for k, g in enumerate(grads) if g.is_sparse}
        dense = [k for k, g in enumerate(grads) if k not in sparse and g is not self.grads[k]]
        if dense:  # none: the largest bucket's, the buffers themselves
            torch._foreach_copy_([self.grads[k] for k in dense], [grads[k] for k in dense])
        return sparse

    def _bind_grads(self, sparse: dict[int, torch.Tensor] | None = None) -> None:
        for k, (p, g) in enumerate(zip(self.params, self.grads)):
            g = sparse.get(k, g) if sparse else g
            if p.grad is not g:
                p.grad = g

    def bucket(self, batch: dict) -> int | None:
        for i, static in enumerate(self.statics):
            if static.fits(batch):
                return i
        return None

    def __call__(self, batch: dict) -> torch.Tensor:
        """Run the step's forward and backward for `batch` (on the device); returns the loss
        (a fresh tensor) and leaves the gradients in the parameters' ``.grad``."""
        if not self.graphs:
            raise RuntimeError("GraphedTrainStep.capture() must run before the first step")
        i = self.bucket(batch)
        if i is None:
            return self._eager(batch)
        static = self.statics[i]
        static.fill(batch)
        if self.lookup is not None:
            plan, send, _ = self.plans[i]
            plan.replay()
            self.lookup.fetch(send, static.capacity + static.batch_size + 1)
        self.graphs[i].replay()
        if self.lookup is not None:
            self.lookup.send_back(self.rows_grads[i])
        self.replays[i] += 1
        self._bind_grads(self.sparse[i])
        return self.losses[i].clone()

    def _eager(self, batch: dict) -> torch.Tensor:
        self.fallbacks += 1
        if self.fallbacks == 1 or self.fallbacks % 100 == 0:
            log.warning("a batch of %d examples and %d history items fits no CUDA-graph bucket (capacities %s "
                        "for %d examples): trained eagerly (%d such batches so far)",
                        batch["label"].shape[0], int(batch["n_tokens"]), self.capacities,
                        self.statics[0].batch_size, self.fallbacks)
        table = [] if self.lookup is None else [self.lookup.table.weight]  # its exchange's backward runs too
        loss, grads = loss_and_grads(self.loss_fn, model_inputs(batch), batch["label"], self.params + table,
                                     self.autocast_dtype)
        if table:
            table[0].grad, grads = grads[-1], grads[:-1]
        self._bind_grads(self._take(grads))
        return loss
