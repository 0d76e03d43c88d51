"""A random workload for accounting tests: arrivals (n up to 2), aborts and engine steps."""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from sparseserve import SamplingParams


def random_prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(10, 2000) for _ in range(rng.randint(1, 60))]


def shared_prefix_prompts(seed: int, num_bases: int = 3, max_len: int = 60) -> Callable[[random.Random], list[int]]:
    """Prompts that share prefixes at random lengths: a random cut of one of a few base prompts plus a random
    tail (sometimes none: a whole repeat of a cut), so cache hits start and stop anywhere in a block."""
    base_rng = random.Random(f"bases:{seed}")
    bases = [[base_rng.randrange(10, 2000) for _ in range(max_len)] for _ in range(num_bases)]

    def prompt(rng: random.Random) -> list[int]:
        head = rng.choice(bases)[: rng.randint(0, max_len)]
        tail = [rng.randrange(10, 2000) for _ in range(rng.choice([0, 0, rng.randint(1, 12)]))]
        return (head + tail)[:max_len] or [rng.randrange(10, 2000)]

    return prompt


def drive_random_schedule(
    engine,
    rng: random.Random,
    steps: int,
    max_new: int,
    after_step: Callable[[list], None],
    greedy: bool = False,
    prompts: Callable[[random.Random], list[int]] = random_prompt,
    aborted: set[str] | None = None,
    params: Callable[[random.Random], SamplingParams] | None = None,
) -> list[str]:
    """Runs `steps` rounds of (maybe add, maybe abort, step); after_step sees each step's outputs.
    greedy: no sampled requests (their tokens then do not depend on the schedule). prompts: each new
    request's prompt from the schedule's random state. The workload (prompts, parameters, which request an
    abort names) depends only on rng, never on the engine, so two engines see the same requests; an abort of
    a request that already finished does nothing (aborted: collects the ids aborts named). Returns the ids of
    requests still unfinished. params: each new request's SamplingParams from the schedule's random state
    (default: random max_tokens up to max_new, n up to 2, greedy or temperature 1, ignore_eos)."""
    added: list[str] = []
    done: set[str] = set()
    for i in range(steps):
        r = rng.random()
        if r < 0.4:
            prompt = prompts(rng)
            if params is not None:
                p = params(rng)
            else:
                p = SamplingParams(
                    max_tokens=rng.randint(1, max_new),
                    temperature=rng.choice([0.0, 1.0]) * (not greedy),
                    n=rng.choice([1, 1, 2]),
                    ignore_eos=True,
                )
            engine.add_request(f"r{i}", prompt, p)
            added.append(f"r{i}")
        elif r < 0.5 and added:
            victim = added[rng.randrange(len(added))]
            engine.abort_request(victim)
            done.add(victim)
            if aborted is not None:
                aborted.add(victim)
        outs = engine.step()
        done.update(o.request_id for o in outs if o.finished)
        after_step(outs)
    return [rid for rid in added if rid not in done]


def held_blocks(engine) -> list[int]:
    """Every token block held by a running or waiting sequence, checked against the allocator (a block shared
    through the prefix cache once per holder: its reference count; a block in no table: free or evictable;
    the leading cached blocks of each table cached under the sequence's own hashes); with KV offload also the
    device blocks (each mapped once, only by running sequences, inside their tables)."""
    from collections import Counter

    seqs = engine.scheduler.running + list(engine.scheduler.waiting)
    held = [b for s in seqs for b in s.block_table]
    alloc = engine.allocator
    refs = Counter(held)
    assert len(refs) == alloc.num_used
    assert all(alloc.ref_count(b) == r for b, r in refs.items()), "reference count != holders"
    alloc.check()
    if alloc.cache is not None:
        for s in seqs:
            for j in range(s.num_cached_blocks):
                h = alloc.cache.hash_of(s.block_table[j])
                assert h is None or h == s.block_hashes[j], "a held block is cached under other tokens"
    offload = engine.model_runner.offload
    if offload is not None:
        dm = engine.scheduler.kv.device_space.map
        if not dm.changed:  # every plan taken: the runner's ranges are the scheduler's
            assert offload.ranges == dm.ranges
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


class CachedBlockContents:
    """Checks that a block's contents never change while it stays cached under one hash: K/V of every layer
    and the key metadata (under KV offload the sparse layers' host store rows, the dense layers' K/V and the
    metadata where they are: the block's device row while one is mapped, else its host row). A snapshot is
    taken when a block is first seen cached and dropped when it leaves the cache (evicted, maybe reused: also
    when a step evicts it, rewrites it for a new owner and caches it again under the same hash)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.seen: dict[int, tuple[bytes, list]] = {}
        self.num_checked = 0
        self.evicted: set[int] = set()  # since the last check
        cache = engine.allocator.cache
        if cache is not None:
            evict = cache.evict

            def recorded():
                block, h = evict()
                self.evicted.add(block)
                return block, h

            cache.evict = recorded  # this engine's cache only

    def data(self, block: int) -> list:
        runner = self.engine.model_runner
        off = runner.offload
        km = getattr(runner.attn_backend, "key_meta", None)
        if off is None:
            out = [c[block] for c in runner.kv_caches]
            if km is not None:
                out += [km.codes[:, block], km.scale[:, block]]
            return [t.clone() for t in out]
        dl = off.dense_layers
        out = [off.host.data[dl:, block]]  # the sparse layers: the host store
        row = int(off.row_of[block])
        if row < off.layout.rows:  # a running sequence holds it: its device row
            out += [c[row] for c in runner.kv_caches[:dl]] + [km.codes[dl:, row], km.scale[dl:, row]]
        else:  # saved to its host row
            out += [off.host.data[layer, block] for layer in range(dl)]
            out += [off.host_meta[0][dl:, block], off.host_meta[1][dl:, block]]
        return [t.clone() for t in out]

    def check(self) -> None:
        cache = self.engine.allocator.cache
        if cache is None:
            return
        if self.engine.model_runner.offload is not None:
            self.engine.model_runner.offload.sync()
        current = dict(cache._hash_of)
        for b in [b for b, (h, _) in self.seen.items() if current.get(b) != h or b in self.evicted]:
            del self.seen[b]
        self.evicted.clear()
        for b, h in current.items():
            now = self.data(b)
            if b in self.seen:
                assert all(map(torch.equal, self.seen[b][1], now)), f"cached block {b} was overwritten"
                self.num_checked += 1
            else:
                self.seen[b] = (h, now)
