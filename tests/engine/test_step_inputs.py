"""A decode batch's rows kept from step to step (engine/step_inputs.py SteadyRows) equal the rows built from
scratch each step: token-block tables (the runner's) and device-block tables of the offload cache's windows,
while sequences open blocks at different steps and one outgrows the others (the tables widen)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from sparseserve.engine.request import Sequence
from sparseserve.engine.step_inputs import SteadyRows, tables_of
from sparseserve.kvcache.device_space import DeviceBlockMap
from sparseserve.sampling_params import SamplingParams

BS = 4


@pytest.mark.parametrize("space", ["token", "device"])
def test_rows_kept_across_steps_equal_rows_built_afresh(space):
    rng = random.Random(space)
    dm = DeviceBlockMap(num_blocks=64, local_blocks=2, block_size=BS, token_blocks=200)
    next_block = iter(range(7, 200))
    seqs = []
    for i, length in enumerate((5, 8, 13, 30, 2)):
        seq = Sequence(i, "r", 0, [rng.randrange(50) for _ in range(length)], SamplingParams(max_tokens=99))
        seq.block_table = [next(next_block) for _ in range(-(-(length + 1) // BS))]
        dm.map(seq, length)
        seq.num_computed_tokens = length
        seq.token_ids.append(1)  # its first decode next
        seqs.append(seq)
    if space == "token":
        row_of, pad = (lambda s: (0, s.block_table)), 0  # noqa: E731
    else:
        row_of, pad = (lambda s: dm.ranges[s.seq_id]), dm.num_blocks  # noqa: E731
    rows, rebuilt, steps = None, 0, 3 * BS + 2
    lens = [len(s.block_table) for s in seqs]
    for _ in range(steps):
        scheduled = [(seq, 1) for seq in seqs]
        for seq in seqs:  # what the scheduler does: a block for the token, the window moved
            if seq.num_computed_tokens // BS >= len(seq.block_table):
                seq.block_table.append(next(next_block))
            if not dm.steady(seq, 1):
                dm.map(seq, 1)
        changed = (
            dm.take_changed()
            if space == "device"
            else [s.seq_id for s, n in zip(seqs, lens) if len(s.block_table) != n]
        )
        lens = [len(s.block_table) for s in seqs]
        want_tables = tables_of(scheduled, row_of, pad)
        want_slots = []
        for seq in seqs:
            start, blocks = row_of(seq)
            c = seq.num_computed_tokens
            want_slots.append(blocks[c // BS - start] * BS + c % BS)
        if rows is None:
            rows = SteadyRows.build(scheduled, row_of, pad, BS)
            assert np.array_equal(rows.tables, want_tables)
        else:
            assert rows.fits(scheduled)
            rebuilt += len(changed)
            slots, tables, pos = rows.update(scheduled, changed)
            assert slots.tolist() == want_slots and pos.tolist() == [s.num_computed_tokens for s in seqs]
            assert np.array_equal(tables[:, : want_tables.shape[1]], want_tables)
            assert (tables[:, want_tables.shape[1] :] == pad).all()
        for seq in seqs:
            seq.num_computed_tokens += 1
            seq.token_ids.append(1)
    assert 0 < rebuilt < len(seqs) * (steps - 1)  # some rows kept, some rebuilt
    assert not rows.fits([(seq, 1) for seq in seqs[:-1]]) and not rows.fits([(seqs[0], 2)] + [(s, 1) for s in seqs[1:]])
    assert SteadyRows.build([(seqs[0], 3)], row_of, pad, BS) is None
