"""The item table sharded by rows over the processes (``model.table_layout sharded``).

Over a shard group of S processes, row ``i`` lives on its rank ``i % S`` at local row ``i // S``. A
lookup sends each distinct id to its owner and gets its row back (an all-to-all of ids, then of rows,
as TorchRec's row-wise sharding); the backward sends the rows' gradients to their owners, which add
them into the shard's gradient. The all-to-all's sizes are read on the host; at a fixed capacity
(``TABLE_EXCHANGES`` gather: a training step's ids padded to a size every process knows) the
lookup all-gathers the ids, each owner fills its rows, and a reduce-scatter returns them, with no
host sync (more bytes: ``sent_bytes_gather``). With W / S > 1 groups, each holds the whole table and the shards'
gradients are summed across groups. Layout, bytes, checkpoints: docs/training.md#sharded-item-table.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from pipeline.dist import rank, world_size
from pipeline.gradsync import all_gather_into, allreduce_bytes

TABLE_LAYOUTS = ("replicated", "sharded")
TABLE_EXCHANGES = ("alltoall", "gather")
_CHUNK_ROWS = 1 << 20  # rows per collective when a shard is gathered or its optimizer state
_INDEXED_ELEMENTS = 1 << 30  # elements per index_add_ into a shard's gradient


def shard_groups(world: int, shards: int) -> tuple[list[list[int]], list[list[int]]]:
    """(shard groups, replica groups) of `world` ranks tiled by tables of `shards` processes each:
    consecutive ranks shard one table (a node's processes, when `shards` is their count), and the
    ranks holding the same shard of every table form a replica group."""
    if shards < 1 or world % shards:
        raise ValueError(f"table_shards {shards} does not divide the world size {world}")
    return ([list(range(g, g + shards)) for g in range(0, world, shards)],
            [list(range(r, world, shards)) for r in range(shards)])


def shard_rows(vocab_size: int, rank: int, world: int) -> int:
    """Rows of the table that rank `rank` of `world` holds."""
    return (vocab_size - rank + world - 1) // world


def sent_bytes_alltoall(send: list[int], recv: list[int], rank: int, row_bytes: int) -> int:
    """Bytes one process sends for one lookup and its backward: its ids to the other owners
    (int64), the rows asked of it back, and the gradients of its rows to their owners."""
    ids_out, rows_in = sum(send) - send[rank], sum(recv) - recv[rank]
    return ids_out * 8 + rows_in * row_bytes + ids_out * row_bytes


def sent_bytes_gather(t_max: int, world: int, row_bytes: int) -> int:
    """Bytes one process would send with the RowwiseParallel-style lookup instead: every process's
    ids all-gathered (padded to the step's largest count `t_max`), each process's partial rows
    reduce-scattered back, and in the backward the rows' gradients all-gathered (ring collectives)."""
    return (world - 1) * t_max * (8 + 2 * row_bytes)


def add_rows(into: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``into[index] += rows`` (repeated indices add up), in blocks of rows of fewer than
    _INDEXED_ELEMENTS elements: CUDA's index_add_ fails on a tensor of 2^31 elements or more (a
    shard of 25M x 128)."""
    step = max(1, _INDEXED_ELEMENTS // max(1, into[0].numel()))
    if into.shape[0] <= step:
        return into.index_add_(0, index, rows)
    for lo in range(0, into.shape[0], step):
        mine = ((index >= lo) & (index < lo + step)).nonzero().squeeze(1)
        into[lo:lo + step].index_add_(0, index[mine] - lo, rows[mine])
    return into


def per_row(state, rows: int) -> bool:
    """Whether an optimizer state holds one entry per row of a table of `rows` rows (AdamW's moments,
    the row-wise Adagrad's sums): the part of a checkpoint that is sharded like the table."""
    return torch.is_tensor(state) and state.dim() > 0 and state.shape[0] == rows


def shard_grad(table: "ShardedEmbedding", local: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The shard's gradient: `rows` [N, D] added at its rows `local` (repeats add up), the mean over
    processes (as DDP's). With ``table.sparse_grad`` a sparse one of N rows, uncoalesced (no sizes
    read on the host: pipeline.optim sums its repeats); else dense."""
    rows = rows.div_(table.world * table.replicas)
    if table.sparse_grad:
        return torch.sparse_coo_tensor(local[None], rows, table.weight.shape)
    return add_rows(rows.new_zeros(table.weight.shape), local, rows)


class _Exchange(torch.autograd.Function):
    """Rows of `ids` from the shards (forward) and their gradients back to the shards (backward)."""

    @staticmethod
    def forward(ctx, weight, ids, table):
        W, r = table.world, table.rank
        uniq, inverse = torch.unique(ids.reshape(-1).long(), return_inverse=True)  # [U], [N]
        owner = uniq % W
        order = torch.argsort(owner, stable=True)
        send_ids = uniq[order]  # [U] grouped by owner
        counts = torch.cat([torch.bincount(owner, minlength=W), owner.new_tensor([ids.numel()])])  # [W + 1]
        every = counts.new_empty(W * (W + 1))  # the concatenated form: Gloo has no other
        all_gather_into(every, counts, group=table.group)
        every = every.view(W, W + 1).tolist()  # a host sync: the exchange's sizes must be known
        send, recv = every[r][:W], [row[r] for row in every]
        recv_ids = send_ids.new_empty(sum(recv))
        dist.all_to_all_single(recv_ids, send_ids, recv, send, group=table.group)
        local = recv_ids // W  # [R] rows of this shard asked for by every process
        rows = weight.detach().index_select(0, local)  # [R, D]
        got = rows.new_empty(sum(send), rows.shape[1])
        dist.all_to_all_single(got, rows, send, recv, group=table.group)
        by_id = torch.empty_like(got)
        by_id[order] = got  # [U, D] in the order of uniq
        ctx.save_for_backward(inverse, order, local)
        ctx.table, ctx.send, ctx.recv = table, send, recv
        table.count(send, recv, max(row[W] for row in every), rows.shape[1] * rows.element_size())
        return by_id.index_select(0, inverse).view(*ids.shape, rows.shape[1])

    @staticmethod
    def backward(ctx, grad_out):
        inverse, order, local = ctx.saved_tensors
        table = ctx.table
        grad_uniq = grad_out.new_zeros(order.numel(), grad_out.shape[-1])
        grad_uniq.index_add_(0, inverse, grad_out.reshape(-1, grad_out.shape[-1]))  # [U, D]
        grad_rows = grad_uniq.new_empty(local.numel(), grad_uniq.shape[1])
        dist.all_to_all_single(grad_rows, grad_uniq[order].contiguous(), ctx.recv, ctx.send, group=table.group)
        return shard_grad(table, local, grad_rows), None, None


def _reduce_scatter(out: torch.Tensor, rows: torch.Tensor, group) -> None:
    """out = this rank's block of the sum over the group of `rows` ([W * C, D] -> [C, D]); Gloo
    (the CPU tests) has no reduce-scatter: an all-reduce and a slice."""
    if dist.get_backend(group) == "gloo":
        dist.all_reduce(rows, group=group)
        r = dist.get_rank(group)
        out.copy_(rows[r * out.shape[0]:(r + 1) * out.shape[0]])
    else:
        dist.reduce_scatter_tensor(out, rows, group=group)


def gather_rows(weight: torch.Tensor, ids: torch.Tensor, table: "ShardedEmbedding", capacity: int):
    """The fixed-capacity lookup's forward, outside autograd: every process's ids ([n <= C], padded
    with -1) all-gathered, each owner's rows of them (zeros elsewhere) reduce-scattered back.
    Returns the rows [n, D] and what :func:`scatter_grads` needs. No size is read on the host."""
    W, n, D = table.world, ids.numel(), weight.shape[1]
    padded = ids.new_full((capacity,), -1, dtype=torch.int64)
    padded[:n] = ids.reshape(-1)
    every = padded.new_empty(W * capacity)
    all_gather_into(every, padded, group=table.group)
    mine = (every >= 0) & (every % W == table.rank)  # [W * C] the ids this shard holds
    local = torch.where(mine, every // W, 0)
    rows = weight.detach().index_select(0, local) * mine[:, None].to(weight.dtype)  # [W * C, D]
    out = rows.new_empty(capacity, D)
    _reduce_scatter(out, rows, table.group)
    table.count_gather(capacity, D * weight.element_size())
    return out[:n], (local, mine, n)


def scatter_grads(grad_out: torch.Tensor, saved: tuple, table: "ShardedEmbedding") -> torch.Tensor:
    """The lookup's backward: the rows' gradients [n, D] all-gathered, each owner's added into a
    gradient of its shard (the mean over processes, as DDP's), returned."""
    (local, mine, n), D = saved, table.weight.shape[1]
    C = local.numel() // table.world
    grad = grad_out.new_zeros(C, D)
    grad[:n] = grad_out.reshape(-1, D)
    every = grad.new_empty(table.world * C, D)
    all_gather_into(every, grad, group=table.group)
    return shard_grad(table, local, every * mine[:, None].to(every.dtype))  # others' ids: zeros to row 0


class _GatherExchange(torch.autograd.Function):
    """The lookup at a fixed capacity C (gather_rows), its backward scatter_grads."""

    @staticmethod
    def forward(ctx, weight, ids, table, capacity):
        rows, saved = gather_rows(weight, ids, table, capacity)
        ctx.save_for_backward(*saved[:2])
        ctx.table, ctx.n = table, saved[2]
        return rows.view(*ids.shape, weight.shape[1])

    @staticmethod
    def backward(ctx, grad_out):
        return scatter_grads(grad_out, (*ctx.saved_tensors, ctx.n), ctx.table), None, None, None


class GraphedLookup:
    """The fixed-capacity lookup around a captured local step (model.cuda_graphs with the sharded
    table): before the replay the rows of a bucket's ids into its static `rows` buffer, after it
    their gradients (the replay's `rows_grad`) to the shards. Every collective stays outside the
    graph, at sizes fixed by the capacity, so the step reads nothing on the host."""

    def __init__(self, table: "ShardedEmbedding", capacity: int):
        self.table, self.capacity, self._saved = table, capacity, None

    @torch.no_grad()
    def fetch(self, ids: list[torch.Tensor], rows: torch.Tensor) -> None:
        got, self._saved = gather_rows(self.table.weight, torch.cat([i.reshape(-1).long() for i in ids]),
                                       self.table, self.capacity)
        rows.copy_(got)

    @torch.no_grad()
    def send_back(self, rows_grad: torch.Tensor) -> None:
        self.table.weight.grad = scatter_grads(rows_grad, self._saved, self.table)


class ShardedEmbedding(nn.Module):
    """The rows ``rank::world`` of an item table of `num_embeddings` rows, looked up by global ids.

    ``weight`` ([shard_rows(V, rank, world), D]) is this process's shard; a lookup
    ``ids [*] -> [*, D]`` (or a :meth:`prefetch`) is a collective: every process of `group` (the
    `world` processes sharding one table) must make as many (an empty `ids` takes part too).
    `replica_group`: the `replicas` processes holding this same shard (None: one), whose gradients
    :meth:`sync_replicas` sums. The gradient is the mean over all processes, as DDP's.
    """

    def __init__(self, shard: torch.Tensor, num_embeddings: int, rank: int, world: int, group=None,
                 replica_group=None, replicas: int = 1):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, shard.shape[1]
        self.rank, self.world, self.group = rank, world, group
        self.replica_group, self.replicas = replica_group, replicas
        self.weight = nn.Parameter(shard)
        self.sent_bytes = self.gather_bytes = self.lookups = 0
        self.sparse_grad = False  # the gradient as a sparse tensor of the looked-up rows (shard_grad)
        self._fetched: list[tuple[torch.Tensor, torch.Tensor]] = []

    @classmethod
    def over(cls, full: torch.Tensor, shards: int = 0) -> "ShardedEmbedding":
        """This process's shard of `full` ([V, D]): :meth:`drawn` with its rows."""
        return cls.drawn(lambda r, w: full.detach()[r::w].clone(), *full.shape, shards)

    @classmethod
    def drawn(cls, rows, num_embeddings: int, dim: int, shards: int = 0) -> "ShardedEmbedding":
        """This process's shard in the default process group, tiled by tables of `shards` processes
        (0: all), its values ``rows(rank, world)`` (the table's rows ``rank::world``); a collective
        (every rank creates every group). ValueError if `shards` does not divide the world size."""
        world, shards = world_size(), shards or world_size()
        tables, replicas = shard_groups(world, shards)
        if world == 1:
            return cls(rows(0, 1), num_embeddings, 0, 1)
        # the lookups' own groups, apart from DDP's
        shard_group = [dist.new_group(ranks) for ranks in tables][rank() // shards]
        replica_group = [dist.new_group(ranks) for ranks in replicas][rank() % shards] if shards < world else None
        return cls(rows(rank() % shards, shards), num_embeddings, rank() % shards, shards, shard_group,
                   replica_group, world // shards)

    def prefetch(self, *ids: torch.Tensor, capacity: int = 0) -> None:
        """One exchange for the rows of every tensor of `ids`; each lookup of one of those very
        tensors that follows gets its rows from it (once), instead of an exchange of its own.
        `capacity` > 0 (the same on every process, at least the ids' total): the fixed-size
        exchange without a host sync (_GatherExchange); 0: the all-to-all."""
        self._fetched = []
        flat = torch.cat([i.reshape(-1).long() for i in ids])
        if capacity and self.world > 1:
            if flat.numel() > capacity:
                raise ValueError(f"{flat.numel()} ids exceed the lookup capacity {capacity}")
            rows = _GatherExchange.apply(self.weight, flat, self, capacity)
        else:
            rows = self(flat)  # [sum of numel, D]
        self.use_rows(*ids, rows=rows)

    def use_rows(self, *ids: torch.Tensor, rows: torch.Tensor) -> None:
        """As :meth:`prefetch`, with the rows of every tensor of `ids` given (GraphedLookup's buffer)."""
        self._fetched = list(zip(ids, rows.split([i.numel() for i in ids])))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        for k, (key, rows) in enumerate(self._fetched):
            if key is ids:
                del self._fetched[k]
                return rows.view(*ids.shape, rows.shape[-1])
        if self.world == self.replicas == 1:
            return nn.functional.embedding(ids.long(), self.weight)
        return _Exchange.apply(self.weight, ids, self)

    def sync_replicas(self) -> None:
        """After the backward: the shard's gradient summed over its replicas (a no-op with one)."""
        if self.replicas > 1 and self.weight.grad is not None:
            self.weight.grad = self.weight.grad.to_dense()  # an all-reduce takes dense tensors
            dist.all_reduce(self.weight.grad, group=self.replica_group)
            self.sent_bytes += allreduce_bytes(self.weight.grad.numel() * self.weight.grad.element_size(), self.replicas)

    def count_gather(self, capacity: int, row_bytes: int) -> None:
        sent = sent_bytes_gather(capacity, self.world, row_bytes)
        self.sent_bytes += sent
        self.gather_bytes += sent
        self.lookups += 1

    def count(self, send: list[int], recv: list[int], t_max: int, row_bytes: int) -> None:
        self.sent_bytes += sent_bytes_alltoall(send, recv, self.rank, row_bytes)
        self.gather_bytes += sent_bytes_gather(t_max, self.world, row_bytes)
        self.lookups += 1

    def gather(self, shard: torch.Tensor) -> torch.Tensor | None:
        """On rank 0, the whole ``[V, *]`` tensor (CPU) whose rows ``r::W`` are rank r's `shard`
        (the weight or an optimizer state of it); None elsewhere. A collective, in chunks."""
        V, W = self.num_embeddings, self.world
        if W == 1:
            return shard.detach().cpu()
        full = torch.empty(V, *shard.shape[1:], dtype=shard.dtype) if self.rank == 0 else None
        for lo in range(0, shard_rows(V, 0, W), _CHUNK_ROWS):
            hi = min(lo + _CHUNK_ROWS, shard_rows(V, 0, W))
            part = shard.new_zeros(hi - lo, *shard.shape[1:])
            mine = shard[lo:hi]
            part[: mine.shape[0]] = mine
            every = part.new_empty(W * (hi - lo), *shard.shape[1:])
            all_gather_into(every, part, group=self.group)
            if full is not None:
                every = every.view(W, hi - lo, *shard.shape[1:]).transpose(0, 1).reshape(-1, *shard.shape[1:])
                n = min(W * hi, V) - W * lo  # the last chunk's padding rows are dropped
                full[W * lo: W * lo + n] = every[:n].cpu()
        return full

    def save_whole(self, checkpoint: dict, key: str, index: int) -> None:
        """Into a checkpoint being written (every rank dumps, rank 0 writes): the whole table at
        state_dict `key` and the whole of its optimizer state (the optimizer's state `index`)."""
        whole = self.gather(checkpoint["state_dict"][key])
        checkpoint["state_dict"][key] = checkpoint["state_dict"][key] if whole is None else whole
        for opt_state in checkpoint.get("optimizer_states") or []:  # none in a weights-only checkpoint
            states = opt_state["state"]
            if index in states:  # a new dict: the one there is the optimizer's own
                states[index] = {k: self.gather(v) if per_row(v, self.weight.shape[0]) else v
                                 for k, v in states[index].items()}

    def load_rows(self, checkpoint: dict, key: str, index: int) -> None:
        """A checkpoint being loaded (the whole table, any layout) cut to this shard's rows."""
        state = checkpoint["state_dict"]
        state[key] = state[key][self.rank::self.world].contiguous()
        for opt_state in checkpoint.get("optimizer_states") or []:
            rows = opt_state["state"].get(index, {})
            for k, v in rows.items():
                if per_row(v, self.num_embeddings):
                    rows[k] = v[self.rank::self.world].contiguous()  # fused AdamW miscomputes on strided state
