"""A step's small host -> device copies: the pinned staging ring (kvcache/transfer.py PinnedStaging,
to_device_many) and the decode graphs' static inputs (engine/staging.py StaticInputs)."""

from __future__ import annotations

import pytest
import torch

from sparseserve.attention.backend import InputField
from sparseserve.engine.staging import StaticInputs
from sparseserve.kvcache.transfer import PinnedStaging, to_device_many
from tests.kernel_utils import DEVICE, gpu_only


def _batch(g: torch.Generator, n: int) -> list[torch.Tensor]:
    """Mixed dtypes and shapes of a step's inputs: slots, lengths, a block table, flags, sampling floats, an
    empty tensor and a non-contiguous one."""
    table = torch.randint(0, 1000, (n, 7), generator=g, dtype=torch.int32)
    return [
        torch.randint(-1, 10**9, (n,), generator=g),
        torch.randint(0, 8192, (n + 1,), generator=g).int(),
        table,
        torch.rand(n, generator=g) > 0.5,
        torch.rand(n, generator=g),
        torch.empty(0, dtype=torch.long),
        table[:, ::2],
    ]


def test_to_device_many_keeps_values_dtypes_and_shapes():
    g = torch.Generator().manual_seed(0)
    for n in (1, 3, 33):
        host = _batch(g, n)
        dev = to_device_many(host, DEVICE)
        assert [t.device.type for t in dev] == [DEVICE.type] * len(host)
        for h, d in zip(host, dev):
            assert d.dtype == h.dtype and d.shape == h.shape and torch.equal(d.cpu(), h)


@gpu_only
def test_staging_reuses_slabs_only_after_their_copies():
    """A small ring wraps around many times while a long kernel keeps the stream busy: every upload still
    arrives intact (a slab is rewritten only once its copies are done), on two streams; an upload larger than
    a slab takes the allocator's way."""
    g = torch.Generator().manual_seed(1)
    staging = PinnedStaging(DEVICE, num_slabs=3, slab_bytes=1024)
    side = torch.cuda.Stream(DEVICE)
    sent, got = [], []
    for i in range(60):
        if i % 10 == 0:
            torch.cuda._sleep(5_000_000)  # keeps the stream busy while the host refills the ring
        stream = side if i % 3 == 0 else torch.cuda.current_stream(DEVICE)
        with torch.cuda.stream(stream):
            host = _batch(g, 1 + i % 9)
            sent.append([t.clone() for t in host])
            dev = staging.upload(host)
            got.append([t.clone() for t in dev])  # on the stream of its copy
            for t in host:  # the caller may reuse its host tensors at once
                if t.numel() and t.dtype != torch.bool:
                    t.zero_()
    torch.cuda.synchronize()
    for s, d in zip(sent, got):
        for h, x in zip(s, d):
            assert torch.equal(x.cpu(), h)
    large = [torch.arange(600, dtype=torch.long)]  # 4800 bytes > one slab
    assert torch.equal(staging.upload(large)[0].cpu(), large[0])


FIELDS = [
    InputField("ids", torch.long),
    InputField("slot", torch.long, pad=-1),
    InputField("lens", torch.int32),
    InputField("tables", torch.int32, width=9, pad=77),
    InputField("more", torch.int32, width=5, pad=-3),
]


def _step(g: torch.Generator, rows: int) -> tuple[list[torch.Tensor], list[str | None]]:
    """One step's tensors: every field (tables narrower than their width) and unnamed ones for the scratch (a
    strided one and a bfloat16 one among them: no numpy dtype)."""
    host = [
        torch.randint(0, 10**6, (rows,), generator=g),
        torch.randint(-1, 10**6, (rows,), generator=g),
        torch.randint(1, 9000, (rows,), generator=g, dtype=torch.int32),
        torch.randint(0, 500, (rows, int(torch.randint(1, 10, (1,), generator=g))), generator=g, dtype=torch.int32),
        torch.randint(0, 500, (rows, 5), generator=g, dtype=torch.int32),
        torch.arange(rows + 1, dtype=torch.int32),
        torch.rand(rows, generator=g) > 0.5,
        torch.empty(0),
        torch.randint(0, 10**6, (2 * rows,), generator=g)[::2],
        torch.randn(rows, generator=g).bfloat16(),
    ]
    return host, ["ids", "slot", "lens", "tables", "more", None, None, None, None, None]


def _check(inputs: StaticInputs, bucket: int, host: list[torch.Tensor], dev: list[torch.Tensor]) -> None:
    """Each view holds its tensor; the bucket's padding rows and a table's entries beyond its width hold the
    field's pad value."""
    for h, d in zip(host, dev):
        assert d.dtype == h.dtype and d.shape == h.shape and torch.equal(d.cpu(), h)
    rows = host[0].shape[0]
    full = inputs.views(bucket)
    for f in FIELDS:
        t = full[f.name].cpu()
        assert (t[rows:] == f.pad).all(), f.name
        if f.width:
            width = host[[x.name for x in FIELDS].index(f.name)].shape[1]
            assert (t[:rows, width:] == f.pad).all(), f.name


def test_static_inputs_hold_each_steps_rows_and_padding():
    """Steps of random sizes in turn (the buckets share one device buffer, the ring of host slabs wraps many
    times): every view holds its step's values, padding rows and entries beyond a table's width the pad."""
    g = torch.Generator().manual_seed(2)
    buckets = [1, 2, 4, 8, 16, 24]
    inputs = StaticInputs(FIELDS, buckets, DEVICE, scratch_bytes=256, num_slabs=2)
    for b in buckets:  # reset: padding everywhere
        inputs.reset(b)
        assert all((t.cpu() == f.pad).all() for f, t in zip(FIELDS, inputs.views(b).values()))
    for _ in range(40):
        rows = int(torch.randint(1, 25, (1,), generator=g))
        bucket = next(b for b in buckets if b >= rows)
        host, names = _step(g, rows)
        up = inputs.begin(bucket)
        dev = up.add(host[:3], names[:3]) + up.add(host[3:], names[3:])  # two components' adds
        up.commit()
        up.commit()  # a second commit copies nothing more
        _check(inputs, bucket, host, dev)


def test_static_inputs_pad_what_a_slabs_last_write_left():
    """A slab keeps the padding its last write of a field left, so a step writes padding only where its rows or
    table width shrank (a steady batch writes none): one slab, so every step rewrites the one before it, rows and
    widths growing, shrinking and staying, and another bucket's step (the layouts overlap) in between."""
    g = torch.Generator().manual_seed(6)
    inputs = StaticInputs(FIELDS, [4, 8, 16], DEVICE, scratch_bytes=256, num_slabs=1)
    plan = [(8, 9), (8, 9), (3, 9), (8, 4), (8, 9), (2, 2), (16, 7), (8, 9), (8, 9), (5, 3), (8, 1), (4, 9), (8, 8)]
    for rows, width in plan:
        bucket = next(b for b in (4, 8, 16) if b >= rows)
        host, names = _step(g, rows)
        host[3] = torch.randint(0, 500, (rows, width), generator=g, dtype=torch.int32)
        up = inputs.begin(bucket)
        dev = up.add(host, names)
        up.commit()
        _check(inputs, bucket, host, dev)


def test_static_inputs_refuse_what_does_not_fit():
    inputs = StaticInputs(FIELDS, [1, 4], DEVICE)
    with pytest.raises(RuntimeError, match="outside a step"):
        inputs.add([torch.zeros(1, dtype=torch.long)], ["ids"])
    up = inputs.begin(4)
    for bad in (torch.zeros(4, dtype=torch.int32), torch.zeros(5, dtype=torch.long)):
        with pytest.raises(ValueError, match="'ids'"):
            up.add([bad], ["ids"])
    with pytest.raises(ValueError, match="'tables'"):
        up.add([torch.zeros(2, 10, dtype=torch.int32)], ["tables"])
    # a step whose building failed is dropped: the next one begins anew
    g = torch.Generator().manual_seed(3)
    host, names = _step(g, 3)
    up = inputs.begin(4)
    dev = up.add(host, names)
    up.commit()
    _check(inputs, 4, host, dev)


@gpu_only
def test_static_inputs_reuse_slabs_only_after_their_copies():
    """While a long kernel keeps the stream busy the host builds several steps ahead: each step's copy still
    carries its own values (a slab is rewritten only once its copy is done); read on the stream right after
    each commit, as the step's kernels would."""
    g = torch.Generator().manual_seed(4)
    inputs = StaticInputs(FIELDS, [4, 8], DEVICE, scratch_bytes=256, num_slabs=2)
    sent, got = [], []
    for i in range(30):
        if i % 7 == 0:
            torch.cuda._sleep(5_000_000)
        host, names = _step(g, 1 + i % 8)
        up = inputs.begin(4 if i % 8 < 4 else 8)
        dev = up.add(host, names)
        up.commit()
        sent.append(host)
        got.append([t.clone() for t in dev])
    torch.cuda.synchronize()
    for s, d in zip(sent, got):
        for h, x in zip(s, d):
            assert torch.equal(x.cpu(), h)
