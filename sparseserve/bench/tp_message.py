"""Rank 0's step message under tensor parallelism (engine/parallel.py), measured alone: its pickled size and the
time of its broadcast over a gloo group of `tp` processes on this host, for `batch` decodes at `context` tokens,
with whole block tables against a steady decode step's (SentTables: the entries added since the last step).
scripts/tp_bench.py's `message` mode."""

from __future__ import annotations

import pickle
import socket
import time

import numpy as np
import torch.distributed as dist
import torch.multiprocessing as mp

from sparseserve.engine.parallel import SeqView, StepMessage

REPEATS = 50


def measure(tp: int, batch: int, context: int, block_size: int) -> list[dict]:
    """One row per message kind: bytes, and the median broadcast time in ms (rank 0's, after a barrier)."""
    with socket.socket() as s:  # a free port for the group's rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank, args=(tp, port, batch, context, block_size, out), nprocs=tp)
    return [out.get() for _ in range(2)]


def _rank(rank: int, tp: int, port: int, batch: int, context: int, block_size: int, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp)
    blocks = -(-context // block_size)
    table = np.arange(blocks, dtype=np.int32)
    for name, start in (("whole tables", 0), ("steady decode", blocks)):
        views = [(SeqView(i, context - 1, context, [1], table[start:], start), 1) for i in range(batch)]
        msg = StepMessage([], views)
        times = []
        for _ in range(REPEATS):
            dist.barrier()
            t0 = time.perf_counter()
            dist.broadcast_object_list([msg if rank == 0 else None], src=0)
            times.append(time.perf_counter() - t0)
        if rank == 0:
            times.sort()
            out.put({"message": name, "bytes": len(pickle.dumps(msg)), "broadcast_ms": times[len(times) // 2] * 1e3})
    dist.destroy_process_group()
