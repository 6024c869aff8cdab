"""LightningModule around :class:`models.Ranker`: BCE loss, AdamW, ranking metrics.

Logged names (MLflow metric keys): ``train/loss_step``, ``train/loss_epoch``,
``{val,test}/{auc,logloss,ne,calibration}``. NE is normalised by the entropy of the TRAINING
CTR (``data_spec["train_ctr"]``) for every split.

In a distributed run (Lightning's DDP strategy) every value is global: the training losses are
means over all processes' examples, and the evaluation metrics are computed from the states of
every process (torchmetrics' reductions: sums, and for AUC every prediction gathered), each
evaluation example counted once (the data module shards evaluation without padding).
``comm/sent_mb_per_step`` says what each process sent for gradients (:mod:`pipeline.gradsync`).
"""

from __future__ import annotations

import ctypes
import functools
import gc
import logging
import time
from dataclasses import asdict
from typing import Literal

import numpy as np
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchmetrics import MeanMetric

from models import Ranker, RankerConfig, feature_width
from models.layers import draw_item_rows
from pipeline.dist import all_reduce, rank, world_size
from pipeline.errors import ConfigError
from pipeline.gradsync import EMBEDDING_GRADS, GradSync
from pipeline.cuda_graphs import GraphedTrainStep, StaticBatch, loss_and_grads, token_capacities
from pipeline.metrics import ranking_metrics
from pipeline.optim import OPTIMIZERS, build_optimizer, param_groups, table_index
from pipeline.table import GraphedLookup, TABLE_EXCHANGES, TABLE_LAYOUTS, ShardedEmbedding

log = logging.getLogger(__name__)

# torchmetrics' compute() already reduced these over every process: the max of equal values
# keeps them exact and tells Lightning that they are synchronised (it warns otherwise)
_SAME_EVERYWHERE = {"sync_dist": True, "reduce_fx": "max"}
_LOSS_STATES = ("train_loss.mean_value", "train_loss.weight")  # the epoch's running loss in a checkpoint
_TABLE = "model.embed.item.weight"
_MODEL_INPUTS = ("hist_item", "hist_action", "hist_age", "offsets", "max_seq_len", "cand_item", "dense")


class CumulativeMean(MeanMetric):
    """Weighted cumulative mean (over an epoch) whose update never synchronises the GPU.

    torchmetrics' MeanMetric checks every update for NaN (``nans.any()``: a device sync per
    training step, which stalls the host behind the GPU) and turns a Python weight into a
    host-to-device copy. Non-finite losses are caught by RankerModule's own flag instead."""

    def update(self, value: torch.Tensor, weight: float = 1.0) -> None:  # type: ignore[override]
        self.mean_value += value.detach().to(self.mean_value.dtype).sum() * weight
        self.weight += weight * value.numel()


class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN or inf; the message names the first such step."""


class RankerModule(pl.LightningModule):
    """The ranker, its loss and optimizer, and the training step (model.* options).

    Before the first training step on a GPU every kernel the step uses runs once (is compiled)
    on a batch of the data's shape, so that the first steps already run at speed; that time is
    logged as perf/prepare_s.

    Args:
        ranker: the architecture (models.RankerConfig; ranker.attention picks dense, sdpa or jagged).
        lr: the optimizer's learning rate.
        table_lr: the item table's, under every optimizer but adamw (default: lr).
        weight_decay: the optimizer's weight decay.
        betas: AdamW's betas (and the item table's, under lazyadam).
        data_spec: sizes and training CTR of the data set (linked from the data module; not set by hand).
        compile_model: run the ranker's forward through torch.compile(dynamic=True): one graph for
            every batch (T symbolic, the jagged kernels opaque custom ops in it); the first step
            compiles.
        cuda_graphs: on a CUDA device, run each training step's forward and backward as the replay
            of a CUDA graph per token bucket (pipeline/cuda_graphs.py): microseconds of host time per
            step instead of a few hundred kernel launches. Same losses and gradients as the eager
            step; 32-true or bf16-mixed precision; not with compile_model; a sparse item table
            gradient has each bucket's size (its own buffer); ignored on CPU. DDP averages the replayed ones by one
            bucketed all-reduce outside the graph; a sharded table (table_exchange alltoall_fixed)
            exchanges its rows and their gradients outside it (pipeline.table.GraphedLookup).
        token_buckets: token capacities (one CUDA graph each, or on the CPU one fixed batch shape
            each); more pad less and take longer to capture.
        optimizer: adamw (default), sgd, adagrad, rowwise or lazyadam (AdamW, the item table row-wise
            Adagrad, one float of state per row, or Lazy Adam, only the rows a step used; pipeline/optim.py;
            all but adamw treat the three embedding_grad modes alike, AdamW cannot: that module says why).
        embedding_grad: the item table's gradient: dense (default), sparse or densify
            (pipeline/gradsync.py: how it is computed and averaged over processes); sparse needs
            an optimizer other than adamw. Same function and, with those, the same training.
        table_layout: replicated (default: every process holds the whole item table, DDP averages
            its gradient) or sharded (each of W processes holds every W-th row and lookups exchange
            ids and rows, never the table's gradient: pipeline/table.py); embedding_grad dense or
            sparse (the shard's, at a fixed size). Checkpoints hold the whole table in either layout.
        table_exchange: with the sharded layout, how a training step's lookup moves ids and rows:
            alltoall (default: each distinct id to its owner, the sizes read on the host every
            lookup) or alltoall_fixed (each owner a fixed number of slots in every process's
            message, the data's largest count for one owner: no host sync; pipeline/table.py).
            Evaluation uses the all-to-all.
        table_shards: with the sharded layout, the processes that shard one table (0: all of them;
            it must divide the world size): each group of table_shards consecutive ranks (a node's
            processes, when it is their count) holds the whole table, and the groups sum their
            shards' gradients with one all-reduce."""

    def __init__(
        self,
        ranker: RankerConfig = RankerConfig(),
        lr: float = 1e-3,
        table_lr: float | None = None,
        weight_decay: float = 0.01,
        betas: tuple[float, float] = (0.9, 0.98),
        data_spec: dict | None = None,
        compile_model: bool = False,
        cuda_graphs: bool = False,
        token_buckets: int = 4,
        optimizer: Literal["adamw", "sgd", "adagrad", "rowwise", "lazyadam"] = "adamw",
        embedding_grad: Literal["dense", "sparse", "densify"] = "dense",
        table_layout: Literal["replicated", "sharded"] = "replicated",
        table_shards: int = 0,
        table_exchange: Literal["alltoall", "alltoall_fixed"] = "alltoall",
    ):
        super().__init__()
        if data_spec is None:
            raise ValueError("RankerModule needs data_spec (vocab_size, n_actions, n_dense, train_ctr)")
        if isinstance(ranker, dict):  # e.g. from a checkpoint's hyper_parameters
            ranker = RankerConfig(**ranker)
        if cuda_graphs and compile_model:
            raise ConfigError("model.cuda_graphs and model.compile_model exclude each other: choose one")
        if token_buckets < 1:
            raise ConfigError(f"model.token_buckets must be >= 1, got {token_buckets}")
        _check_gradients(optimizer, embedding_grad)
        if table_lr is not None and (optimizer == "adamw" or table_lr <= 0):
            raise ConfigError(f"model.table_lr must be > 0 and set only with a model.optimizer other than adamw "
                              f"(AdamW trains the table at model.lr); got {table_lr} with {optimizer}")
        _check_layout(table_layout, embedding_grad, compile_model, cuda_graphs, table_exchange, table_shards)
        # plain types only: checkpoints stay loadable with torch.load(weights_only=True); not the
        # table's layout, which a checkpoint's hyper-parameters would impose on the command loading it
        self.save_hyperparameters(
            {"ranker": asdict(ranker), "lr": lr, "table_lr": table_lr, "weight_decay": weight_decay, "betas": list(betas),
             "data_spec": dict(data_spec), "compile_model": bool(compile_model),
             "cuda_graphs": bool(cuda_graphs), "token_buckets": int(token_buckets), "optimizer": optimizer,
             "embedding_grad": embedding_grad},
            logger=False,
        )
        # the step is written out (forward, backward, optimizer step) so that it can be a graph replay
        self.automatic_optimization = False
        self.lr, self.table_lr, self.weight_decay, self.betas = lr, table_lr, weight_decay, tuple(betas)
        self.compile_model, self._compiled = bool(compile_model), None
        self.cuda_graphs, self.token_buckets = bool(cuda_graphs), int(token_buckets)
        self._graphs: GraphedTrainStep | None = None
        self._cpu_buckets: list[StaticBatch] = []
        self._eval_statics: dict[tuple[int, int], StaticBatch] = {}
        self.optimizer_name, self.sharded, self.table_shards = optimizer, table_layout == "sharded", table_shards
        self._table_bytes = [0, 0, 0]  # training lookups of this process: bytes sent, a gather's bytes, steps
        self.table_exchange, self._lookup_slots = table_exchange, 0  # alltoall_fixed's slots: set at train start
        self.model = Ranker(ranker, vocab_size=data_spec["vocab_size"], n_actions=data_spec["n_actions"],
                            n_dense=data_spec["n_dense"], sparse_item_grad=embedding_grad != "dense",
                            n_categories=data_spec.get("n_categories", 0),
                            item_device="meta" if self.sharded else None)  # each process draws its shard in setup
        table = self.model.embed.item.weight
        self.grad_sync = GradSync(embedding_grad, table, list(self.model.parameters()),
                                  manual_table=self.cuda_graphs or self.sharded)
        self.data_spec_n_dense = feature_width(int(data_spec["n_dense"]), ranker)  # a batch's "dense" columns
        self.val_metrics = nn.ModuleDict(ranking_metrics(data_spec["train_ctr"]))
        self.test_metrics = nn.ModuleDict(ranking_metrics(data_spec["train_ctr"]))
        # the epoch's running mean and its epoch are checkpointed, so a run resumed mid-epoch
        # logs the same mean as an uninterrupted one (and one resumed at an epoch end starts afresh)
        self.train_loss = CumulativeMean()
        self.train_loss.persistent(True)
        self.register_buffer("train_loss_epoch", torch.tensor(-1, dtype=torch.int64))
        # first step whose loss was not finite (-1: none); checked without a sync every step
        self.register_buffer("_bad_step", torch.tensor(-1, dtype=torch.int64), persistent=False)
        # DDP leaves out what GradSync averages, and every buffer: constants, the epoch number
        # (equal everywhere) and each process's own NaN flag, so no step broadcasts buffers
        ignored = [name for name, _ in self.named_buffers()]
        ignored += [_TABLE] if self.grad_sync.manual_table else []
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(self, ignored)

    def forward(self, batch: dict) -> torch.Tensor:
        inputs = {k: batch[k] for k in _MODEL_INPUTS}
        if self.sharded and "item_rows" in batch:  # a captured step's rows, looked up around its replay
            self.model.embed.item.use_rows(inputs["hist_item"], inputs["cand_item"], rows=batch["item_rows"])
        elif self.sharded:  # one exchange for the ranker's two lookups of these very tensors
            B = batch["label"].shape[0] if "label" in batch else inputs["cand_item"].shape[0]  # a bucket's extra one pads
            self.model.embed.item.prefetch(inputs["hist_item"], inputs["cand_item"], limits=(inputs["offsets"][B], B),
                                           slots=self._lookup_slots if self.training else 0)
        if not self.compile_model:
            return self.model(**inputs)
        if self._compiled is None:  # built on first use, after the module has moved to its device
            self._compiled = torch.compile(self.model.forward, dynamic=True)
        return self._compiled(**inputs)

    def setup(self, stage: str) -> None:
        """The data set's item categories into the category embedding. The item table's initial rows
        are drawn from the seed on the device the run trains on, for either layout: with the sharded
        layout the table becomes this process's shard (the process group exists from here on), its
        rows those of the replicated table of the same seed and device (an equal start)."""
        dm, device = getattr(self.trainer, "datamodule", None), self.trainer.strategy.root_device
        if self.model.embed.category is not None and hasattr(dm, "item_categories"):
            self.model.embed.set_categories(dm.item_categories())  # the data set's catalogue
        if not self.sharded and stage == "fit" and device.type == "cuda":  # drawn as a shard is: CUDA's generator
            weight = self.model.embed.item.weight
            weight.data.copy_(draw_item_rows(self.model.embed.item_seed, *weight.shape, device=device))
        if not self.sharded or isinstance(self.model.embed.item, ShardedEmbedding):
            return
        try:
            embed = self.model.embed
            rows = functools.partial(draw_item_rows, embed.item_seed, *embed.item.weight.shape, device=device)
            embed.item = ShardedEmbedding.drawn(rows, *embed.item.weight.shape, self.table_shards)
            embed.item.sparse_grad = self.hparams.embedding_grad == "sparse"
        except ValueError as err:
            raise ConfigError(f"model.{err}: every process must hold one shard of one whole table") from None
        self.grad_sync = GradSync("dense", self.model.embed.item.weight, list(self.model.parameters()),
                                  manual_table=True, local_table=True)

    def on_train_epoch_start(self) -> None:
        if int(self.train_loss_epoch) != self.current_epoch:
            self.train_loss.reset()
            self.train_loss_epoch.fill_(self.current_epoch)

    def compute_loss(self, batch: dict) -> torch.Tensor:
        """Mean BCE of the batch's logits (the eager training step's forward)."""
        return F.binary_cross_entropy_with_logits(self(batch), batch["label"])

    def _graph_loss(self, inputs: dict, label: torch.Tensor) -> torch.Tensor:
        # the loss of a bucket's padded batch: its extra padding example (past len(label)) is dropped
        return F.binary_cross_entropy_with_logits(self({**inputs, "label": label})[: label.shape[0]], label)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        opt, step = self.optimizers(), self.global_step
        sent = (self.model.embed.item.sent_bytes, self.model.embed.item.gather_bytes) if self.sharded else None
        if self._graphs is not None:
            loss = self._graphs(batch)  # forward + backward replayed; gradients in .grad
        else:
            opt.zero_grad(set_to_none=True)
            loss = self._bucketed_loss(batch) if self._cpu_buckets else self.compute_loss(batch)
            self.manual_backward(loss)
            loss = loss.detach()
        self.grad_sync(all_grads=self._graphs is not None)
        if self.sharded:  # the shards' replicas summed; the bytes of the step's lookups (host integers, no sync)
            table, counts = self.model.embed.item, self._table_bytes
            table.sync_replicas()
            counts[:] = [counts[0] + table.sent_bytes - sent[0], counts[1] + table.gather_bytes - sent[1], counts[2] + 1]
        opt.step()
        bad = ~torch.isfinite(loss)
        self._bad_step.copy_(torch.where(bad & (self._bad_step < 0), step, self._bad_step))
        self.train_loss.update(loss, weight=batch["label"].numel())
        # Logged only on the steps the loggers write (every log_every_n_steps, where Lightning
        # reads the values anyway): each self.log costs host time, and a value shown in the
        # progress bar (prog_bar=True) is read after every step, a device sync that would
        # serialise the host and the GPU. The bar shows the loss through callbacks.ProgressBar.
        if self.global_step % self.trainer.log_every_n_steps == 0:
            self.log("train/loss_step", loss, on_step=True, sync_dist=True)  # the mean over processes
            self.check_finite_loss()
        return loss

    # ---- before the first step: kernels compiled, graphs captured ---------------------------
    def _bucketed_loss(self, batch: dict) -> torch.Tensor:
        """The eager loss on the batch padded to its token bucket (pipeline.graphs.StaticBatch)."""
        for static in self._cpu_buckets:
            if static.fits(batch):
                static.fill(batch)
                return self._graph_loss(static.inputs(), static.label)
        return self.compute_loss(batch)  # above the largest capacity (another data set): as is

    def on_train_start(self) -> None:
        self.grad_sync.broadcast()
        counts = self._token_counts()  # the steps' sizes, once, for every use below
        if self.sharded and self.table_exchange == "alltoall_fixed":
            if counts is None:
                raise ConfigError("model.table_exchange alltoall_fixed needs the RankerData data module (its steps' ids)")
            # one size on every process: the most distinct ids of one owner in a planned step (2% more: the
            # epochs past the 20 planned; check_finite_loss says if an id found no slot)
            steps = self.trainer.max_steps if self.trainer.max_steps and self.trainer.max_steps > 0 else None
            most = self.trainer.datamodule.train_owner_counts(self._planned_epochs(), self.model.embed.item.world,
                                                              steps).max(initial=0)
            self._lookup_slots = int(all_reduce(torch.tensor(int(most * 1.02) + 1, device=self.device), "max"))
        caps = token_capacities(counts, self.token_buckets) if counts is not None and len(counts) else []
        if self.device.type == "cuda":
            self._prepare_step(counts, caps)
        else:
            if self.cuda_graphs:
                log.warning("model.cuda_graphs needs a CUDA device; training eagerly on %s", self.device)
            # on the CPU too a step runs on a batch padded to one of a few token capacities: allocations of a few
            # sizes do not fragment the C heap (which grew tens of MB per hundred steps with a new size every step)
            dm = self.trainer.datamodule
            self._cpu_buckets = [StaticBatch(c, dm.batch_size, self.data_spec_n_dense, dm.max_seq_len, self.device)
                                 for c in caps]
            keep_heap()
        # what is alive now is never traversed by the GC again (a full collection took hundreds of ms)
        gc.collect()
        gc.freeze()

    def _prepare_step(self, counts: np.ndarray | None, caps: list[int]) -> None:
        """Kernels compiled (and graphs captured) on batches of the data's shape (its steps' token
        counts, and their buckets `caps`), before step 1."""
        t0 = time.perf_counter()
        if not caps:
            return
        dm, amp = self.trainer.datamodule, autocast_dtype(self.trainer.precision)
        table = self.model.embed.item
        graphed = self.sharded and self.cuda_graphs and table.world > 1  # rows exchanged around each replay
        lookup = GraphedLookup(table, self._lookup_slots) if graphed else None
        params = [p for p in self.parameters() if p.requires_grad and not (lookup and p is table.weight)]
        if self.cuda_graphs:
            if amp == torch.float16:
                raise ConfigError("model.cuda_graphs supports trainer.precision 32-true and bf16-mixed "
                                  "(16-mixed needs a gradient scaler outside the graph)")
            self._graphs = GraphedTrainStep(self._graph_loss, params, caps, dm.batch_size, self.data_spec_n_dense,
                                            dm.max_seq_len, self.device, amp, lookup)
            try:
                self._graphs.capture()
                what = f"{len(caps)} CUDA graphs captured (token capacities {caps})"
            except torch.OutOfMemoryError as err:
                self._graphs = None  # the graphs' memory pool goes with them
                torch.cuda.empty_cache()
                log.warning("not enough GPU memory to capture the training step as CUDA graphs (%s): training "
                            "eagerly", str(err).split(".")[0])
                what = "CUDA graphs did not fit in GPU memory: eager steps"
            # every process steps alike (a replayed step and an eager one make other collectives): eager if one is
            captured = int(all_reduce(torch.tensor(float(self._graphs is not None), device=self.device), "min"))
            if self._graphs is not None and not captured:
                self._graphs, what = None, "CUDA graphs did not fit in another process's GPU memory: eager steps"
                torch.cuda.empty_cache()
                log.warning("another process could not capture its CUDA graphs: training eagerly, as it does")
        else:  # one forward and backward on a batch of the data's shape: every kernel compiled now
            static = StaticBatch(int(np.median(counts)), dm.batch_size, self.data_spec_n_dense, dm.max_seq_len,
                                 self.device)
            loss_and_grads(self._graph_loss, static.inputs(), static.label, params, amp)
            torch.cuda.synchronize(self.device)
            if self.sharded:  # that batch's stale ids are no step's: not counted as lost
                table.overflow.zero_()
            what = "kernels compiled on a batch of the data's shape"
        elapsed = time.perf_counter() - t0
        log.info("training step prepared in %.1f s: %s", elapsed, what)
        for logger in self.trainer.loggers:
            logger.log_metrics({"perf/prepare_s": elapsed}, step=self.global_step)

    def _token_counts(self) -> np.ndarray | None:
        """History items of every training batch of the planned epochs (the data module's
        exact schedule: RankerData.train_token_counts), or None when the data module cannot say."""
        dm = getattr(self.trainer, "datamodule", None)
        if dm is None or not hasattr(dm, "train_token_counts"):
            log.warning("no RankerData data module: no token buckets (CUDA graphs, fixed CPU shapes) and no warm-up")
            return None
        return dm.train_token_counts(self._planned_epochs())

    def _planned_epochs(self) -> range:
        # from epoch 0 whatever the epoch a resumed run starts at: the same buckets, the same numbers
        max_epochs = self.trainer.max_epochs if self.trainer.max_epochs and self.trainer.max_epochs > 0 else 20
        return range(min(max_epochs, 20))  # later epochs are alike

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if self.sharded:  # the whole table and its optimizer state, as the replicated layout saves them
            groups = self.optimizers(use_pl_optimizer=False).param_groups
            self.model.embed.item.save_whole(checkpoint, _TABLE, table_index(groups, self.model.embed.item.weight))
        # the running loss of every process (each holds its own examples'): the file gets the
        # global sums, as one process would have them (every process dumps, rank 0 writes)
        if world_size() > 1:
            state = checkpoint["state_dict"]
            for key in _LOSS_STATES:
                state[key] = all_reduce(state[key].clone())

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if self.sharded:  # this process's rows of the whole table and of its optimizer state
            table = self.model.embed.item
            groups = param_groups(self.optimizer_name, list(self.parameters()), table.weight, self.weight_decay)
            table.load_rows(checkpoint, _TABLE, table_index(groups, table.weight))
        if rank() != 0:  # rank 0 carries the global sums on, the others add from zero
            state = checkpoint["state_dict"]
            for key in _LOSS_STATES:
                state[key] = torch.zeros_like(state[key])

    def on_train_epoch_end(self) -> None:
        self.check_finite_loss()
        self.log("train/loss_epoch", self.train_loss.compute(), on_step=False, on_epoch=True, **_SAME_EVERYWHERE)

    def on_train_end(self) -> None:
        comm = self.grad_sync.metrics()
        sent, gather, steps = self._table_bytes
        if steps and world_size() > 1:  # the lookup run and the RowwiseParallel-style one, per step
            comm.update({"comm/table_sent_mb_per_step": sent / steps / 2**20,
                         "comm/table_gather_mb_per_step": gather / steps / 2**20})
        for logger in self.trainer.loggers if comm else ():
            logger.log_metrics(comm, step=self.global_step)

    def check_finite_loss(self) -> None:
        # the first bad step of any process (every process checks at the same steps)
        none = torch.iinfo(torch.int64).max
        first = all_reduce(torch.where(self._bad_step < 0, none, self._bad_step), "min")
        step = -1 if int(first) == none else int(first)
        lost = int(self.model.embed.item.overflow) if self._lookup_slots else 0
        if lost:  # ids past alltoall_fixed's slots got zero rows
            raise RuntimeError(f"{lost} item ids of this process's steps found no slot of model.table_exchange alltoall_fixed "
                               f"({self._lookup_slots} per owner, the planned epochs' most): use table_exchange alltoall")
        if step >= 0:
            raise NonFiniteLossError(
                f"training loss is NaN/inf at step {step} (global step, 0-based): lower model.lr, "
                "check the data (python -m data_gen validate ...) or use fp32 precision"
            )

    def _eval_step(self, metrics: nn.ModuleDict, batch: dict) -> None:
        if batch["label"].numel() == 0:  # this process's share of a last, short evaluation batch
            if self.sharded and world_size() > 1:  # the other shards' lookups still need this one
                self.model.embed.item.prefetch(batch["hist_item"], batch["cand_item"])
            return
        logits = self._eval_logits(batch) if self.device.type == "cpu" else self(batch)
        for metric in metrics.values():
            metric.update(logits, batch["label"])

    def _eval_logits(self, batch: dict) -> torch.Tensor:
        """Logits of an evaluation batch on the CPU, padded to a token capacity of a geometric
        ladder (ratio 1.125): a few fixed shapes, as in training, so the heap does not fragment."""
        B, T = int(batch["label"].shape[0]), int(batch["n_tokens"])
        cap = eval_capacity(T)
        static = self._eval_statics.get((B, cap))
        if static is None:
            static = self._eval_statics[(B, cap)] = StaticBatch(cap, B, self.data_spec_n_dense,
                                                                int(batch["max_seq_len"]), self.device)
        static.fill(batch)
        return self(static.inputs())[:B]

    def _log_eval(self, metrics: nn.ModuleDict, prefix: str) -> None:
        self.log_dict({f"{prefix}/{name}": m.compute() for name, m in metrics.items()}, prog_bar=False,
                      **_SAME_EVERYWHERE)
        for m in metrics.values():
            m.reset()

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._eval_step(self.val_metrics, batch)

    def on_validation_epoch_end(self) -> None:
        self._log_eval(self.val_metrics, "val")

    def test_step(self, batch: dict, batch_idx: int) -> None:
        self._eval_step(self.test_metrics, batch)

    def on_test_epoch_end(self) -> None:
        self._log_eval(self.test_metrics, "test")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # fused AdamW (CUDA and CPU): one pass over every parameter instead of a dozen foreach
        # passes (the 1M-row item table alone is 128M parameters at the paper preset; on the CPU
        # the `small` ranker's update takes a tenth of the foreach time)
        fused = self.device.type in ("cuda", "cpu") or None
        return build_optimizer(self.optimizer_name, list(self.parameters()), self.model.embed.item.weight, lr=self.lr,
                               weight_decay=self.weight_decay, betas=self.betas, fused=fused, table_lr=self.table_lr)


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_heap() -> bool:
    """Let the C heap keep the memory a training step frees, for the next step (glibc only;
    False where it did not apply).

    By default glibc serves a large block (from 128 KiB, a threshold it raises as it goes) with
    a fresh mmap and returns it on free, and hands the heap's free top back to the system: the
    next step's blocks of those sizes (the item table's gradient and each optimizer temporary,
    activations) then cost a page fault per 4 KiB page touched. Which blocks that hits depends
    on the order of every allocation before, so it changes from run to run and from one
    attention layout to the other. Fixed thresholds (blocks up to 32 MiB from the heap, its
    free top returned only above 1 GiB) end that: a step reuses the pages of the one before,
    and the process stays at its high-water mark instead of shrinking between steps."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):  # no mallopt (macOS, Windows)
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30))


def _check_gradients(optimizer: str, embedding_grad: str) -> None:
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"model.optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    if embedding_grad not in EMBEDDING_GRADS:
        raise ConfigError(f"model.embedding_grad must be one of {', '.join(EMBEDDING_GRADS)}, got {embedding_grad!r}")
    if embedding_grad == "sparse" and optimizer == "adamw":
        raise ConfigError("model.embedding_grad sparse needs model.optimizer sgd, adagrad, rowwise or lazyadam: AdamW "
                          "updates every row of the table on every step (lazyadam only the rows a step used)")


def _check_layout(layout: str, embedding_grad: str, compiled: bool, graphs: bool, exchange: str, shards: int) -> None:
    if layout not in TABLE_LAYOUTS:
        raise ConfigError(f"model.table_layout must be one of {', '.join(TABLE_LAYOUTS)}, got {layout!r}")
    if shards < 0 or (shards and layout != "sharded"):
        raise ConfigError(f"model.table_shards must be >= 0 (0: every process), and set only with model.table_layout "
                          f"sharded; got {shards} with {layout}")
    if exchange not in TABLE_EXCHANGES or (exchange != "alltoall" and layout != "sharded"):
        raise ConfigError(f"model.table_exchange is one of {', '.join(TABLE_EXCHANGES)}, and not alltoall only with "
                          f"model.table_layout sharded; got {exchange!r} with {layout}")
    if layout == "sharded" and (embedding_grad == "densify" or compiled or (graphs and exchange == "alltoall")):
        raise ConfigError(f"model.table_layout sharded keeps the table's gradient with its shard: it takes embedding_grad "
                          f"dense or sparse, no compile_model, and cuda_graphs only with table_exchange alltoall_fixed "
                          f"(the plain all-to-all changes its sizes every step and reads them on the host); got "
                          f"embedding_grad {embedding_grad}, table_exchange {exchange}")


def autocast_dtype(precision) -> torch.dtype | None:
    """The autocast dtype of a Lightning precision setting (None: no autocast)."""
    p = str(precision)
    return None if "mixed" not in p else torch.bfloat16 if p.startswith("bf16") else torch.float16


def eval_capacity(tokens: int) -> int:
    """The smallest capacity >= tokens of the ladder 256 * 1.125^k (rounded up to 256 rows)."""
    cap = 256.0
    while cap < tokens:
        cap *= 1.125
    return int(-(-cap // 256) * 256)
