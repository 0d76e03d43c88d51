"""A random workload for accounting tests: arrivals (n up to 2), aborts and engine steps."""
from __future__ import annotations

import random
from collections.abc import Callable

from sparseserve import SamplingParams


def drive_random_schedule(engine, rng: random.Random, steps: int, max_new: int,
                          after_step: Callable[[list], None], greedy: bool = False) -> list[str]:
    """Runs `steps` rounds of (maybe add, maybe abort, step); after_step sees each step's outputs.
    greedy: no sampled requests (their tokens then do not depend on the schedule). Returns the ids of
    requests still unfinished."""
    live: list[str] = []
    for i in range(steps):
        r = rng.random()
        if r < 0.4:
            prompt = [rng.randrange(10, 2000) for _ in range(rng.randint(1, 60))]
            p = SamplingParams(max_tokens=rng.randint(1, max_new), temperature=rng.choice([0.0, 1.0]) * (not greedy),
                               n=rng.choice([1, 1, 2]), ignore_eos=True)
            engine.add_request(f"r{i}", prompt, p)
            live.append(f"r{i}")
        elif r < 0.5 and live:
            engine.abort_request(live.pop(rng.randrange(len(live))))
        outs = engine.step()
        live[:] = [rid for rid in live if not any(o.finished and o.request_id == rid for o in outs)]
        after_step(outs)
    return live


def held_blocks(engine) -> list[int]:
    """Every token block held by a running or waiting sequence, checked against the allocator; with
    KV offload also the device blocks (each mapped once, only by running sequences, inside their tables)."""
    seqs = engine.scheduler.running + list(engine.scheduler.waiting)
    held = [b for s in seqs for b in s.block_table]
    assert len(held) == len(set(held)) == engine.allocator.num_used
    engine.allocator.check()
    offload = engine.model_runner.offload
    if offload is not None:
        dm = offload.device_map
        dev = [b for s in seqs for b in dm.range_of(s)[1]]
        assert len(dev) == len(set(dev)) == dm.allocator.num_used <= dm.num_blocks
        dm.allocator.check()
        assert not any(dm.range_of(s)[1] for s in engine.scheduler.waiting)
        assert all(dm.range_of(s)[0] + len(dm.range_of(s)[1]) <= len(s.block_table) for s in seqs)
        assert set(dm.ranges) <= {s.seq_id for s in engine.scheduler.running}
    return held


def check_pool(offload) -> None:
    """The HBM pool's invariants, and that every resident head block holds its host store row: a pool entry
    never serves contents its block no longer has (blocks handed to a new owner leave the pool)."""
    import torch
    pool = offload.pool
    pool.check()
    keys = torch.nonzero(pool.resident[: pool.num_keys] >= 0)[:, 0]
    slots = pool.resident[keys]
    assert torch.equal(pool.slots[slots].cpu(), offload.host.flat()[keys.cpu()])
