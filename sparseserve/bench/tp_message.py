"""Rank 0's step message under tensor parallelism (engine/parallel.py), measured alone: its pickled size and the
time of its broadcast over the TP group's gloo group of `tp` processes on this host, for `batch` decodes at
`context` tokens, with whole block tables against a steady decode step's (SentTables: the entries added since the
last step), each sent by `TPGroup.broadcast_object` (the engine's) and by `dist.broadcast_object_list` (before).
scripts/tp_bench.py's `message` mode."""

from __future__ import annotations

import os
import pickle
import socket
import time

import numpy as np
import torch.distributed as dist
import torch.multiprocessing as mp

from sparseserve.distributed.group import destroy_tp_group, init_tp_group
from sparseserve.engine.parallel import SeqView, StepMessage

REPEATS = 50


def measure(tp: int, batch: int, context: int, block_size: int) -> list[dict]:
    """One row per message kind and sender: bytes, and the median broadcast time in ms (rank 0's, after a
    barrier)."""
    with socket.socket() as s:  # a free port for the group's rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank, args=(tp, port, batch, context, block_size, out), nprocs=tp)
    return [out.get() for _ in range(4)]


def _rank(rank: int, tp: int, port: int, batch: int, context: int, block_size: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    group = init_tp_group(rank=rank, world_size=tp, local_rank=rank, local_world_size=tp, device_type="cpu")
    blocks = -(-context // block_size)
    table = np.arange(blocks, dtype=np.int32)
    senders = {
        "TPGroup.broadcast_object": group.broadcast_object,
        "broadcast_object_list": _object_list(group.cpu_group),
    }
    for name, start in (("whole tables", 0), ("steady decode", blocks)):
        views = [(SeqView(i, context - 1, context, [1], table[start:], start), 1) for i in range(batch)]
        msg = StepMessage([], views)
        for sender, send in senders.items():
            times = []
            for _ in range(REPEATS):
                dist.barrier(group=group.cpu_group)
                t0 = time.perf_counter()
                got = send(msg if rank == 0 else None)
                times.append(time.perf_counter() - t0)
            # every rank got rank 0's message (a check, not part of the timing)
            assert len(got.scheduled) == batch and all(np.array_equal(v.table, table[start:]) for v, _ in got.scheduled)
            if rank == 0:
                times.sort()
                ms = times[len(times) // 2] * 1e3
                out.put({"message": name, "sender": sender, "bytes": len(pickle.dumps(msg)), "broadcast_ms": ms})
    destroy_tp_group()


def _object_list(cpu_group):
    def send(msg):
        box = [msg]
        dist.broadcast_object_list(box, src=0, group=cpu_group)
        return box[0]

    return send
