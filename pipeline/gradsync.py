"""Gradients across processes: the item table's gradient modes and the all-reduce done by hand.

:class:`GradSync` averages, after the backward and before the optimizer step, what DDP's reducer
cannot: the item table's gradient in ``sparse``/``densify`` mode (``model.embedding_grad``) and
every gradient of a CUDA-graph step (no reducer hooks fire in a replay). The modes, their bytes
and why they train alike: docs/training.md#gradient-sync."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from pipeline.dist import world_size

EMBEDDING_GRADS = ("dense", "sparse", "densify")
BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size
# all_gather_single is the newer name; older torch releases only have the other
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def allreduce_bytes(nbytes: int, world: int) -> int:
    """Bytes one process sends in a ring all-reduce of `nbytes`."""
    return 2 * (world - 1) * nbytes // world


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _gather(t: torch.Tensor, world: int) -> torch.Tensor:
    out = t.new_empty((world * t.shape[0], *t.shape[1:]))  # the concatenated form: Gloo has no other
    all_gather_into(out, t.contiguous())
    return out.view(world, *t.shape)


def allgather_sparse(grad: torch.Tensor, world: int) -> tuple[torch.Tensor, int]:
    """The mean over processes of a sparse COO gradient ``[V, D]`` (coalesced) and the bytes
    this process sent for it."""
    g = grad.coalesce()
    idx, val = g.indices()[0], g.values()  # [n] int64, [n, D]
    counts = _gather(torch.tensor([idx.numel()], device=idx.device), world)[:, 0]  # [W]
    m = int(counts.max())  # a host sync: the padded size must be known
    idx_pad = idx.new_zeros(m)
    idx_pad[: idx.numel()] = idx
    val_pad = val.new_zeros((m, *val.shape[1:]))
    val_pad[: idx.numel()] = val
    all_idx, all_val = _gather(idx_pad, world), _gather(val_pad, world)  # [W, m], [W, m, D]
    real = torch.arange(m, device=idx.device)[None, :] < counts[:, None]  # [W, m]
    mean = torch.sparse_coo_tensor(all_idx[real][None], all_val[real] / world, g.shape,
                                   check_invariants=False).coalesce()  # indices of coalesced tensors: valid
    sent = sum((world - 1) * _nbytes(t) for t in (counts[:1], idx_pad, val_pad))  # ring all-gathers
    return mean, sent


def allreduce_mean(grads: list[torch.Tensor], world: int, bucket_bytes: int = BUCKET_BYTES) -> int:
    """Average dense gradients over processes in place (bucketed); returns the bytes sent."""
    big = [g for g in grads if _nbytes(g) >= bucket_bytes]
    buckets, current, size = [], [], 0
    for g in (g for g in grads if _nbytes(g) < bucket_bytes):
        if current and (size + _nbytes(g) > bucket_bytes or g.dtype != current[0].dtype):
            buckets.append(current)
            current, size = [], 0
        current.append(g)
        size += _nbytes(g)
    if current:
        buckets.append(current)
    flats = [torch.cat([g.reshape(-1) for g in b]) for b in buckets]
    for t in (*big, *flats):
        t.mul_(1.0 / world)  # divided first, as DDP does: the sum cannot overflow a low precision
    works = [dist.all_reduce(t, async_op=True) for t in (*big, *flats)]
    for w in works:
        w.wait()
    for b, flat in zip(buckets, flats):
        torch._foreach_copy_(b, [c.view_as(g) for c, g in zip(flat.split([g.numel() for g in b]), b)])
    return sum(allreduce_bytes(_nbytes(t), world) for t in (*big, *flats))


class GradSync:
    """The gradient averaging this process does itself.

    Args:
        mode: ``model.embedding_grad``.
        table: the item table (``nn.Embedding.weight``).
        params: every trainable parameter, the table included.
        manual_table: average the table here on every step, not in DDP's reducer (always so
            unless mode is dense; with dense, when CUDA graphs are configured).
        bucket_bytes: the size of the flattened buckets of small gradients.
        local_table: the table is this process's shard (pipeline/table.py): never averaged here."""

    def __init__(self, mode: str, table: nn.Parameter, params: list[nn.Parameter], manual_table: bool,
                 bucket_bytes: int = BUCKET_BYTES, local_table: bool = False):
        if mode not in EMBEDDING_GRADS:
            raise ValueError(f"embedding_grad must be one of {EMBEDDING_GRADS}, got {mode!r}")
        self.mode, self.table, self.local_table = mode, table, local_table
        self.manual_table = manual_table or mode != "dense"
        self.others = [p for p in params if p is not table]
        self.bucket_bytes = bucket_bytes
        self.sent_bytes = 0  # by this process, over `steps` synchronised steps
        self.steps = 0

    def __call__(self, all_grads: bool) -> None:
        """After the backward: every gradient averaged over processes (`all_grads`: the reducer
        saw none of them, as after a CUDA-graph replay)."""
        if self.mode == "densify" and self.table.grad.is_sparse:
            self.table.grad = self.table.grad.to_dense()  # in one process too: one optimizer path
        world = world_size()
        if world == 1:
            return
        sent, dense = 0, list(self.others) if all_grads else []
        if self.mode == "sparse":
            self.table.grad, sent = allgather_sparse(self.table.grad, world)
        elif (self.manual_table or all_grads) and not self.local_table:
            dense.insert(0, self.table)
        sent += allreduce_mean([p.grad for p in dense], world, self.bucket_bytes) if dense else 0
        if not all_grads:  # what DDP's reducer sends for the rest
            reduced = self.others + ([] if self.manual_table else [self.table])
            sent += allreduce_bytes(sum(_nbytes(p) for p in reduced), world)
        self.sent_bytes += sent
        self.steps += 1

    def broadcast(self) -> None:
        """Rank 0's table on every process (DDP broadcasts only the parameters it holds)."""
        if self.manual_table and not self.local_table and world_size() > 1:
            dist.broadcast(self.table.data, src=0)

    def metrics(self) -> dict[str, float]:
        """``comm/sent_mb_per_step``: MiB this process sent per step for gradients (none alone)."""
        return {"comm/sent_mb_per_step": self.sent_bytes / self.steps / 2**20} if self.steps else {}
