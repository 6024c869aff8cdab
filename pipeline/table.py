"""The item table sharded by rows over the processes (``model.table_layout sharded``).

Over a shard group of S processes, row ``i`` lives on its rank ``i % S`` at local row ``i // S``. A
lookup sends each distinct id to its owner and gets its row back (an all-to-all of ids, then of rows,
as TorchRec's row-wise sharding); the backward sends the rows' gradients to their owners, which add
them into the shard's gradient. That all-to-all's sizes are read on the host; ``alltoall_fixed``
gives each owner a fixed number of slots of every process's message (the data's largest count of
distinct ids for one owner), so no size is read and a CUDA-graph step can run around it. A RowwiseParallel-style
gather (every process's ids all-gathered, the rows reduce-scattered back) would send about W
times its bytes: ``ShardedEmbedding.gather_bytes`` counts them. With W / S > 1 groups, each holds
the whole table and the shards' gradients are summed across groups. Layout, bytes, checkpoints:
docs/training.md#sharded-item-table.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from pipeline.dist import rank, world_size
from pipeline.gradsync import all_gather_into, allreduce_bytes

TABLE_LAYOUTS = ("replicated", "sharded")
TABLE_EXCHANGES = ("alltoall", "alltoall_fixed")
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


def sent_bytes_fixed(size: int, world: int, row_bytes: int) -> int:
    """Bytes one process sends for a lookup at a fixed size and its backward: `size` ids, rows and
    row gradients to each of the other processes: alltoall_fixed's slots per owner, or for a
    RowwiseParallel-style gather, the step's id count (ring all-gather of the ids, reduce-scatter of
    the rows, all-gather of their gradients)."""
    return (world - 1) * size * (8 + 2 * row_bytes)


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
        row_bytes = rows.shape[1] * rows.element_size()
        table.tally(sent_bytes_alltoall(send, recv, r, row_bytes), max(row[W] for row in every), row_bytes)
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


def masked_ids(ids: list[torch.Tensor], limits) -> torch.Tensor:
    """The flat ids of `ids` with -1 (no row, nothing exchanged) past each one's first `limits[k]`
    entries (an int or a device scalar: no host sync): a bucket's padding, which holds stale ids."""
    flat = [i.reshape(-1).long() for i in ids]
    return torch.cat([torch.where(torch.arange(f.numel(), device=f.device) < n, f, -1)
                      for f, n in zip(flat, [f.numel() for f in flat] if limits is None else limits)])


def plan_slots(ids: torch.Tensor, table: "ShardedEmbedding", slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The alltoall_fixed message of the distinct ids of `ids` (flat [n], -1: none), local work with
    no host sync (a captured graph's): each into one of the `slots` places its owner (id % W) has
    (an id's repeats share its place). Returns the message [W * slots + 1] (-1: an empty place; the
    last one a bin, never sent) and each id's slot [n]. A distinct id past its owner's slots goes
    to the bin, its row zeros, and is counted in ``table.overflow`` (checked at the loss checks)."""
    W = table.world
    owner = torch.where(ids >= 0, ids % W, W)  # [n] W: no owner
    key, order = torch.sort(owner * table.num_embeddings + ids.clamp(min=0))  # by owner, then id
    new = torch.ones_like(key, dtype=torch.bool)
    new[1:] = key[1:] != key[:-1]  # [n] the first of its id, in sorted order
    before = torch.cat([new.new_zeros(1, dtype=torch.long), torch.cumsum(new, 0)])  # [n + 1] distinct ids before
    first = torch.searchsorted(key, torch.arange(W + 1, device=ids.device) * table.num_embeddings)  # [W + 1]
    place, first_of_id = torch.empty_like(order), torch.empty_like(new)
    place[order] = before[1:] - 1 - before[first][key // table.num_embeddings]  # its id's rank among its owner's
    first_of_id[order] = new
    fits = (owner < W) & (place < slots)
    table.overflow += ((owner < W) & ~fits & first_of_id).sum()
    slot = torch.where(fits, owner * slots + place, W * slots)
    send = ids.new_full((W * slots + 1,), -1)
    send[slot] = ids  # an id's repeats into its one slot; the ids that found none into the bin
    return send, slot


def exchange_rows(weight: torch.Tensor, send: torch.Tensor, table: "ShardedEmbedding", got: torch.Tensor, ids: int):
    """plan_slots' message (of `ids` ids) to the owners in one all-to-all of equal parts, their rows (zeros
    for empty places) back into `got` [W * slots, D] in another, tallied. Returns what exchange_grads needs."""
    table.tally(sent_bytes_fixed(got.shape[0] // table.world, table.world, b := got[0].nbytes), ids, b)
    asked = torch.empty_like(send[:-1])
    dist.all_to_all_single(asked, send[:-1], group=table.group)
    mine = asked >= 0  # [W * slots] the ids each process asks of this shard
    local = torch.where(mine, asked // table.world, 0)
    dist.all_to_all_single(got, weight.detach().index_select(0, local) * mine[:, None].to(weight.dtype),
                           group=table.group)
    return local, mine


def exchange_grads(grad: torch.Tensor, local: torch.Tensor, mine: torch.Tensor, table: "ShardedEmbedding"):
    """exchange_rows' backward: the gradients [W * slots, D] of the rows got to their owners by the reverse
    all-to-all, each owner's added into a gradient of its shard (the mean over processes, as DDP's)."""
    every = torch.empty_like(grad)
    dist.all_to_all_single(every, grad.contiguous(), group=table.group)
    return shard_grad(table, local, every * mine[:, None].to(every.dtype))  # empty slots: zeros to row 0


class _FixedExchange(torch.autograd.Function):
    """The alltoall_fixed lookup of `ids` (flat [n], -1: none): plan_slots, then exchange_rows; its
    backward sums the rows' gradients per slot (an id's repeats), then exchange_grads."""

    @staticmethod
    def forward(ctx, weight, ids, table, slots):
        send, slot = plan_slots(ids, table, slots)
        got = weight.new_zeros(send.numel(), weight.shape[1])  # the bin's row stays zeros
        ctx.save_for_backward(*exchange_rows(weight, send, table, got[:-1], ids.numel()), slot)
        ctx.table = table
        return got.index_select(0, slot)

    @staticmethod
    def backward(ctx, grad_out):
        local, mine, slot = ctx.saved_tensors
        grad = grad_out.new_zeros(local.numel() + 1, grad_out.shape[-1])
        grad.index_add_(0, slot, grad_out.reshape(-1, grad.shape[1]))  # the bin last
        return exchange_grads(grad[:-1], local, mine, ctx.table), None, None, None


class GraphedLookup:
    """The alltoall_fixed lookup around a captured step (model.cuda_graphs, sharded table): :meth:`plan`
    (a bucket's graph of its own) makes its ids' message and slots, :meth:`fetch` exchanges them for rows
    into `got` (an input of every step graph, which reads its rows by slot), :meth:`send_back` the replay's
    gradient of `got`. No collective is captured: every process makes the same, whichever bucket it replays."""

    def __init__(self, table: "ShardedEmbedding", slots: int):
        self.table, self.slots, self._saved = table, slots, None
        self.got = table.weight.new_zeros(table.world * slots + 1, table.embedding_dim).requires_grad_()  # bin last

    def plan(self, ids: list[torch.Tensor], limits=None) -> tuple[torch.Tensor, torch.Tensor]:
        """plan_slots of `ids` past `limits` (masked_ids: the rest is a bucket's padding)."""
        return plan_slots(masked_ids(ids, limits), self.table, self.slots)

    @torch.no_grad()
    def fetch(self, send: torch.Tensor, ids: int) -> None:
        """The rows of :meth:`plan`'s message `send` (of `ids` ids) into ``got``."""
        self._saved = exchange_rows(self.table.weight, send, self.table, self.got.detach()[:-1], ids)

    @torch.no_grad()
    def send_back(self, got_grad: torch.Tensor) -> None:
        self.table.weight.grad = exchange_grads(got_grad[:-1], *self._saved, self.table)


class ShardedEmbedding(nn.Module):
    """The rows ``rank::world`` of an item table of `num_embeddings` rows, looked up by global ids.

    ``weight`` ([shard_rows(V, rank, world), D]) is this process's shard; a lookup
    ``ids [*] -> [*, D]`` (or a :meth:`prefetch`) is a collective: every process of `group` (the
    `world` processes sharding one table) must make as many (an empty `ids` takes part too).
    `replica_group`: the `replicas` processes holding this same shard (None: one), whose gradients
    :meth:`sync_replicas` sums. The gradient is the mean over all processes, as DDP's."""

    def __init__(self, shard: torch.Tensor, num_embeddings: int, rank: int, world: int, group=None,
                 replica_group=None, replicas: int = 1):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, shard.shape[1]
        self.rank, self.world, self.group = rank, world, group
        self.replica_group, self.replicas = replica_group, replicas
        self.weight = nn.Parameter(shard)
        self.sent_bytes = self.gather_bytes = self.lookups = 0
        self.overflow = torch.zeros((), dtype=torch.int64, device=shard.device)  # ids past alltoall_fixed's slots
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

    def prefetch(self, *ids: torch.Tensor, slots: int = 0, limits=None) -> None:
        """One exchange for the rows of every tensor of `ids`; each lookup of one of those very
        tensors that follows gets its rows from it (once), instead of an exchange of its own.
        `slots` > 0 (the same on every process): alltoall_fixed with `slots` per owner, no host
        sync, of only the first `limits[k]` ids of each tensor (masked_ids; None: all); 0: the
        all-to-all."""
        self._fetched = []
        if slots and self.world > 1:
            rows = _FixedExchange.apply(self.weight, masked_ids(list(ids), limits), self, slots)
        else:
            rows = self(torch.cat([i.reshape(-1).long() for i in ids]))  # [sum of numel, D]
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

    def tally(self, sent: int, ids: int, row_bytes: int) -> None:
        """A lookup's bytes: `sent`, and what a RowwiseParallel-style gather would send for `ids` ids."""
        self.sent_bytes += sent
        self.gather_bytes += sent_bytes_fixed(ids, self.world, row_bytes)
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
