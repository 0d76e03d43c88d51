"""Tensor parallelism in the engine (docs/tensor_parallel.md): the engine's runner, rank 0's
driver and the workers' loop.

Rank 0 runs the engine; every rank runs a ModelRunner over its shard. Before each step
`TPDriver` sends the workers one `StepMessage` (the step's `SeqView`s and layer-segmented
prefill segments, the sequences released since the last one, the step's OffloadPlan), so every
rank runs the same batch and keeps the same device ranges, pool and selection slots. Only rank
0 samples. A dead rank stops the engine with an error naming it (docs/tensor_parallel.md, "When
something fails").
"""

from __future__ import annotations

import dataclasses
import datetime
import inspect
import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from sparseserve.config import EngineConfig
from sparseserve.distributed.channel import StepChannel
from sparseserve.distributed.group import TPGroup, abort_tp_group, destroy_tp_group, exit_if_end_stuck, init_tp_group
from sparseserve.distributed.launch import (
    WorkerProcesses,
    check_devices,
    report_worker_error,
    torchrun_env,
    worker_setup,
)
from sparseserve.distributed.utils import divide, shard_heads
from sparseserve.engine.overlap import TokenFeed
from sparseserve.engine.runner import ModelRunner, resolve_device
from sparseserve.engine.scheduler.segments import LayerSegment
from sparseserve.kvcache.offload_plan import OffloadPlan
from sparseserve.layers.sampler import SamplerOutput
from sparseserve.models.config import ArchConfig
from sparseserve.models.loader import load_hf_config
from sparseserve.profiler import Profiler

logger = logging.getLogger(__name__)
# What the forkserver imports once for every worker it starts: this module, the components a
# runner builds, and transformers' config classes of the supported architectures.
WORKER_PRELOAD = [
    "sparseserve.engine.parallel",
    "sparseserve.attention.sparse",
    "sparseserve.attention.policies",
    "sparseserve.kvcache.offload",
    "transformers.models.auto.configuration_auto",
    *(f"transformers.models.{m}.configuration_{m}" for m in ("llama", "qwen2", "qwen3", "mistral")),
]


def build_runner(config: EngineConfig, model_dir: Path, profiler: Profiler | None = None) -> "ModelRunner | TPDriver":
    """The engine's runner: a ModelRunner at tensor_parallel_size 1 (no process group), else rank
    0's TPDriver over a worker per other rank. Under torchrun every rank calls this; ranks > 0
    serve rank 0's engine here, then leave the process group and raise SystemExit(0)."""
    tp_size = config.parallel_config.tensor_parallel_size
    env = torchrun_env()
    if env is not None and env.world_size > 1 and env.world_size != tp_size:
        raise ValueError(
            f"started by torchrun with WORLD_SIZE={env.world_size}, but tensor_parallel_size="
            f"{tp_size}: they must be equal (tensor parallelism is the only parallelism here)"
        )
    if tp_size == 1:
        return ModelRunner(config, model_dir, profiler)
    check_model(config, model_dir)
    device_type = resolve_device(config.model_config.device).type
    if env is None:
        return _spawn(config, model_dir, device_type, profiler)
    check_devices(tp_size, device_type, env.local_world_size)
    tp = init_tp_group(
        rank=env.rank,
        world_size=tp_size,
        local_rank=env.local_rank,
        local_world_size=env.local_world_size,
        device_type=device_type,
    )
    if tp.is_driver:
        return TPDriver(ModelRunner(config, model_dir, profiler), _Session(tp, None))
    try:
        runner = ModelRunner(config, model_dir)
        serve(runner, tp)
        runner.release_graphs()
    finally:
        # Before rank 0 leaves (it hosts the store and waits for every rank: _Session.close), and
        # not in the interpreter's teardown (docs/tensor_parallel.md, "Starting the ranks").
        destroy_tp_group()
    exit_if_end_stuck()  # as a spawned worker does: a blocked end must not abort the exit
    raise SystemExit(0)


def check_model(config: EngineConfig, model_dir: Path) -> None:
    """Whether the model splits over tensor_parallel_size ranks (before any process starts)."""
    tp_size = config.parallel_config.tensor_parallel_size
    a = ArchConfig.from_hf(load_hf_config(model_dir))
    shard_heads(a.num_heads, a.num_kv_heads, tp_size)
    divide(a.intermediate_size, tp_size, "the MLP's intermediate_size")


# ---- what rank 0 sends ---------------------------------------------------------------------------


class _StepTokens:
    """A view's token_ids: only the tokens it carries, at their positions (the runner reads
    token_ids[num_computed_tokens:num_computed_tokens + n] and nothing else of them)."""

    def __init__(self, start: int, ids: list[int] | np.ndarray) -> None:
        self.start, self.ids = start, ids

    def __getitem__(self, s: slice) -> list[int] | np.ndarray:
        return self.ids[s.start - self.start : s.stop - self.start]


@dataclass
class SeqView:
    """What a rank's runner, attention backend and offload cache read of a scheduled Sequence."""

    seq_id: int
    num_computed_tokens: int
    num_tokens: int
    step_token_ids: list[int]
    table: np.ndarray  # int32: the block table (in a step message: its entries from table_start on)
    table_start: int = 0

    @classmethod
    def of(cls, seq: Any, n: int, table_start: int = 0) -> "SeqView":
        c = seq.num_computed_tokens
        table = seq.block_table_array()
        return cls(seq.seq_id, c, seq.num_tokens, seq.token_ids[c : c + n], table[table_start:], table_start)

    @property
    def token_ids(self) -> _StepTokens:
        return _StepTokens(self.num_computed_tokens, self.step_token_ids)

    @property
    def block_table(self) -> np.ndarray:
        return self.table.astype(np.int64)  # slot arithmetic in int64, as with Python ints

    def block_table_array(self) -> np.ndarray:
        return self.table


class SentTables:
    """Rank 0: how many entries of each sequence's block table the other ranks hold. Between two
    releases a table only grows (Sequence.block_table_array), so a step message carries only the
    entries added since the sequence's last step (one in 16-32 decode steps, against the whole
    table of a 128K context); a release, paused or not, forgets the sequence: its next view is whole."""

    def __init__(self) -> None:
        self.sent: dict[int, int] = {}

    def view(self, seq: Any, n: int) -> SeqView:
        start = self.sent.get(seq.seq_id, 0)
        size = len(seq.block_table_array())
        if size < start:
            raise RuntimeError(f"sequence {seq.seq_id}: its block table shrank without a release")
        self.sent[seq.seq_id] = size
        return SeqView.of(seq, n, start)

    def forget(self, seq_id: int) -> None:
        self.sent.pop(seq_id, None)


class HeldTables:
    """A worker: each sequence's block table, grown from the step messages' entries (SentTables)
    in a buffer that doubles, so a step costs the new entries, not a copy of the table."""

    def __init__(self) -> None:
        self.tables: dict[int, tuple[np.ndarray, int]] = {}  # seq_id -> (buffer, entries held)

    def complete(self, view: SeqView) -> None:
        """Gives the view its whole table (from its entries and what the earlier steps sent)."""
        buf, held = self.tables.get(view.seq_id, (None, 0))
        if view.table_start != held and view.table_start != 0:
            raise RuntimeError(
                f"sequence {view.seq_id}: a step sent its block table from entry {view.table_start}, "
                f"this rank holds {held}"
            )
        start, size = view.table_start, view.table_start + len(view.table)
        if buf is None or start == 0 or len(buf) < size:
            grown = np.empty(max(size, 2 * held, 16), dtype=np.int32)
            if start:
                grown[:start] = buf[:start]
            buf = grown
        buf[start:size] = view.table
        self.tables[view.seq_id] = (buf, size)
        view.table, view.table_start = buf[:size], 0

    def forget(self, seq_id: int) -> None:
        self.tables.pop(seq_id, None)


@dataclass
class SegmentView:
    """What engine/layer_prefill.py reads of a layer-segmented prefill's sequence. The prompt's
    uncomputed tokens and the block table come with the first segment (layer 0) only: a later
    one continues the prefill in progress, found by seq_id (reading them then raises)."""

    seq_id: int
    num_computed_tokens: int
    num_tokens: int
    new_token_ids: np.ndarray | None  # int32: token_ids[num_computed_tokens:]
    table: np.ndarray | None  # int32: the block table

    @classmethod
    def segment(cls, seg: LayerSegment) -> LayerSegment:
        """`seg` with its sequence replaced by a view (rank 0's segments keep the Sequence)."""
        seq, first = seg.seq, seg.start == 0
        c = seq.num_computed_tokens
        ids = np.asarray(seq.token_ids[c:], dtype=np.int32) if first else None
        view = cls(seq.seq_id, c, seq.num_tokens, ids, seq.block_table_array() if first else None)
        return dataclasses.replace(seg, seq=view)

    def _first(self, what: str, value: np.ndarray | None) -> np.ndarray:
        if value is None:
            raise RuntimeError(f"sequence {self.seq_id}: its {what} came with its first segment only")
        return value

    @property
    def token_ids(self) -> _StepTokens:
        return _StepTokens(self.num_computed_tokens, self._first("token ids", self.new_token_ids))

    @property
    def block_table(self) -> np.ndarray:
        return self._first("block table", self.table)


@dataclass
class StepMessage:
    released: list[tuple[int, bool]] = field(default_factory=list)  # (seq_id, paused): first
    scheduled: list[tuple[SeqView, int]] | None = None  # the step to run (None: none)
    plan: OffloadPlan | None = None  # KV offload: the step's plan
    stop: bool = False
    segments: list[LayerSegment] = field(default_factory=list)  # of SegmentViews, run after `scheduled`
    # async scheduling: seq_id -> row of the previous step's sampled tokens, which rank 0 broadcast on the
    # device after sampling them (ModelRunner.execute); they fill the views' placeholders (None: no feed)
    feed_rows: dict[int, int] | None = None


# ---- rank 0 --------------------------------------------------------------------------------------


class _Session:
    """One engine's process group, channel, spawned workers and watchdog thread; apart from the
    driver so the thread and the finalizer hold no reference to it."""

    POLL_S = 0.1
    LEAVE_TIMEOUT_S = 30.0  # how long rank 0 waits for the other ranks to leave the process group

    def __init__(self, tp: TPGroup, workers: WorkerProcesses | None) -> None:
        self.tp, self.workers = tp, workers
        self.runner: ModelRunner | None = None  # rank 0's: its graphs go before the group does (close)
        self.channel: StepChannel | None = None  # set once every runner is built: heartbeats start
        self.failure: str | None = None
        self.closed = threading.Event()
        self.nccl = tp.device_group is not None and dist.get_backend(tp.device_group) == "nccl"
        self._watchdog = threading.Thread(target=self._watch, name="sparseserve-tp-watchdog", daemon=True)
        self._watchdog.start()

    def _watch(self) -> None:
        while not self.closed.wait(self.POLL_S):
            if self.workers is not None and (msg := self.workers.failure()) is not None:
                self.fail(msg)
                return
            if self.channel is not None:
                try:
                    self.channel.heartbeat()
                except Exception as e:  # noqa: BLE001 - a heartbeat fails when a rank is gone
                    self.fail(f"a tensor-parallel rank stopped answering: {e}")
                    return

    def fail(self, msg: str) -> None:
        """A rank is gone: remember why and release waits on it (NCCL: abort; gloo fails itself)."""
        if self.failure is None and not self.closed.is_set():
            self.failure = msg
            logger.error("%s; the engine stops", msg)
            if self.nccl:
                abort_tp_group()
            if self.workers is not None:
                self.workers.shutdown(timeout_s=0.0)

    def check(self, grace_s: float = 0.0) -> None:
        """Raises if a rank is gone (grace_s: WorkerProcesses.failure's wait_s)."""
        if self.closed.is_set() and self.failure is None:
            raise RuntimeError("the tensor-parallel engine was shut down")
        if self.failure is None and self.workers is not None and (msg := self.workers.failure(grace_s)) is not None:
            self.fail(msg)
        if self.failure is not None:
            self.close()  # leaves the process group: a new engine may start in this process
            raise RuntimeError(f"{self.failure}; the tensor-parallel engine has stopped")

    def close(self) -> None:
        """Tells the other ranks to stop, drops rank 0's decode graphs and leaves the process group
        while they leave theirs, then joins spawned workers (idempotent). On GPUs rank 0's NCCL
        abort blocked when it came after its workers had exited (docs/tensor_parallel.md). The store
        outlives the group (the workers' handle holds it): a worker still leaving can reach it."""
        if self.closed.is_set():
            return
        healthy = self.failure is None
        self.closed.set()
        if healthy and self.channel is not None:
            try:
                self.channel.close(StepMessage(stop=True))
            except Exception as e:  # noqa: BLE001 - a rank went away; it is shut down anyway
                logger.warning("tensor-parallel stop message not delivered: %s", e)
                healthy = False
        if threading.current_thread() is not self._watchdog:
            self._watchdog.join(timeout=5.0)  # sees `closed` within POLL_S: no more heartbeats
        if self.workers is None and healthy and self.channel is not None:
            self._wait_for_ranks_to_leave()
        if self.runner is not None:
            self.runner.release_graphs()
            self.runner = None
        destroy_tp_group()
        if self.workers is not None:
            self.workers.shutdown()

    def _wait_for_ranks_to_leave(self) -> None:
        """torchrun's ranks > 0 leave the process group on the stop message (build_runner): a
        receive from each fails when its connections close (what this waits for), or times out."""
        deadline = time.monotonic() + self.LEAVE_TIMEOUT_S
        for rank in range(1, self.tp.world_size):
            work = dist.irecv(torch.empty(1), src=rank, group=self.tp.cpu_group)
            try:
                work.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.1)))
            except Exception:  # noqa: BLE001 - the rank's connections closed, or the time ran out
                pass
            if time.monotonic() >= deadline:
                logger.warning(
                    "tensor-parallel rank %d did not leave the process group within %.0f s; rank 0 leaves anyway",
                    rank,
                    self.LEAVE_TIMEOUT_S,
                )
                return


class TPDriver:
    """Rank 0's runner of a tensor-parallel engine: the ModelRunner API the engine uses (`execute`,
    `release`, and rank 0's runner's sizes and statistics), each step sent to the workers before it
    runs. Statistics are rank 0's."""

    def __init__(self, runner: ModelRunner, session: _Session) -> None:
        self.runner = runner
        self._session = session
        session.runner = runner
        session.channel = StepChannel(runner.tp)
        self._released: list[tuple[int, bool]] = []
        self._tables = SentTables()
        self._finalizer = weakref.finalize(self, session.close)

    # rank 0's alone: the scheduler's side of the offload, and statistics
    def build_offload_space(self):
        return self.runner.build_offload_space()

    def counters(self) -> dict[str, torch.Tensor]:
        return self.runner.counters()

    def gauges(self) -> dict[str, int]:
        return self.runner.gauges()

    def sync(self) -> None:
        self.runner.sync()

    @property
    def failure(self) -> str | None:
        """Why the engine stopped for good (a rank is gone, a step failed); None while it serves.
        Every later step raises it; the server's /health reads it."""
        return self._session.failure

    def __getattr__(self, name: str) -> Any:
        if name in ("runner", "_session"):
            raise AttributeError(name)
        value = getattr(self.runner, name)
        if inspect.ismethod(value):  # it would run on rank 0 alone and leave the other ranks behind
            raise AttributeError(
                f"ModelRunner.{name} is not available under tensor parallelism: only what "
                f"TPDriver sends to every rank is (engine/parallel.py)"
            )
        return value

    def release(self, seq_id: int, paused: bool = False) -> None:
        self.runner.release(seq_id, paused)
        self._released.append((seq_id, paused))
        self._tables.forget(seq_id)

    def execute(
        self, scheduled: list, segments: list = (), plan: OffloadPlan | None = None, feed: Any = None
    ) -> tuple[list, SamplerOutput | None]:
        s = self._session
        s.check()
        message = StepMessage(
            self._released,
            [(self._tables.view(seq, n), n) for seq, n in scheduled],
            plan,
            segments=[SegmentView.segment(seg) for seg in segments],
            feed_rows=None if feed is None else feed.rows,
        )
        self._released = []
        try:
            with s.channel.hold():
                s.channel.send(message)
                sampled, out = self.runner.execute(scheduled, segments, plan, feed=feed)
                if feed is None and self.runner.device.type == "cuda":
                    # Waiting here lets a dead rank (the watchdog aborts NCCL) become an error,
                    # not a step of garbage tokens the engine reads next (async scheduling: `check`).
                    torch.cuda.current_stream(self.runner.device).synchronize()
        except BaseException as e:  # also Ctrl-C: the ranks are out of step, stop them all
            if isinstance(e, Exception):
                s.check(grace_s=2.0)  # a dead rank explains it better than the collective's error
            s.fail(f"a tensor-parallel step failed: {e!r}")
            s.close()
            if not isinstance(e, Exception):
                raise
            raise RuntimeError(f"a tensor-parallel step failed ({e}); the engine has stopped") from e
        s.check()
        return sampled, out

    def check(self) -> None:
        """Raises if a rank is gone. Async scheduling calls it once a step's outputs landed: a rank that
        died during the step (the watchdog, which noticed first, aborted NCCL) left them garbage."""
        self._session.check()

    def shutdown(self) -> None:
        """Stops the workers and leaves the process group (also at exit or when collected)."""
        self._finalizer()


def _spawn(config: EngineConfig, model_dir: Path, device_type: str, profiler: Profiler | None) -> TPDriver:
    tp_size = config.parallel_config.tensor_parallel_size
    check_devices(tp_size, device_type, tp_size)
    workers = WorkerProcesses(tp_size, _worker_main, (config, model_dir, os.getpid()), preload=WORKER_PRELOAD)
    session = None
    try:
        workers.wait_ready()
        tp = init_tp_group(
            rank=0,
            world_size=tp_size,
            local_rank=0,
            local_world_size=tp_size,
            device_type=device_type,
            store=workers.store,
        )
        session = _Session(tp, workers)
        return TPDriver(ModelRunner(config, model_dir, profiler), session)
    except BaseException as e:
        # A worker's failure explains a failed collective (RuntimeError); rank 0's own errors stand.
        why = workers.failure(wait_s=2.0) if isinstance(e, RuntimeError) else None
        if session is not None:
            session.fail(why or f"rank 0 failed: {e}")
            session.close()
        else:
            workers.shutdown(timeout_s=0.0)
            destroy_tp_group()
        if why is not None:
            raise RuntimeError(why) from e
        raise


# ---- the other ranks -----------------------------------------------------------------------------


def serve(runner: ModelRunner, tp: TPGroup) -> None:
    """A worker's loop: rank 0's messages, in order, until it says stop."""
    channel = StepChannel(tp)
    tables = HeldTables()
    sampled_ids = None  # async scheduling: the last step's tokens, broadcast by rank 0 (the next feed)
    while True:
        try:
            message: StepMessage = channel.recv()
        except RuntimeError as e:
            raise RuntimeError(f"tensor-parallel rank {tp.rank}: lost rank 0 ({e})") from e
        if message.stop:
            return
        for seq_id, paused in message.released:
            runner.release(seq_id, paused)
            tables.forget(seq_id)
        for view, _ in message.scheduled or []:
            tables.complete(view)
        if message.scheduled or message.segments:  # rank 0's order: the batch, then the segments
            feed = None if message.feed_rows is None else TokenFeed(sampled_ids, message.feed_rows)
            _, out = runner.execute(message.scheduled or [], message.segments, message.plan, feed=feed)
            if out is not None:
                sampled_ids = out.token_ids


def _worker_main(
    rank: int, world_size: int, port: int, env: dict[str, str], config: EngineConfig, model_dir: Path, parent_pid: int
) -> None:
    """A worker spawned by rank 0 (distributed/launch.py)."""
    store = worker_setup(rank, port, env, parent_pid)
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s [tp rank {rank}] %(name)s: %(message)s")
    try:
        device_type = resolve_device(config.model_config.device).type
        if device_type == "cpu":  # the ranks of one host share its cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        tp = init_tp_group(
            rank=rank,
            world_size=world_size,
            local_rank=rank,
            local_world_size=world_size,
            device_type=device_type,
            store=store,
        )
        runner = ModelRunner(config, model_dir)
        serve(runner, tp)
        runner.release_graphs()  # before the group ends (ModelRunner.release_graphs)
    except BaseException:
        report_worker_error(store, rank)
        os._exit(1)
    destroy_tp_group()
    exit_if_end_stuck()
