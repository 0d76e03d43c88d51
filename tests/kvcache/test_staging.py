"""The pinned staging of a step's small host -> device copies (kvcache/host.py PinnedStaging, to_device_many)."""
from __future__ import annotations

import torch

from sparseserve.kvcache.host import PinnedStaging, to_device_many
from tests.kernel_utils import DEVICE, gpu_only


def _batch(g: torch.Generator, n: int) -> list[torch.Tensor]:
    """Mixed dtypes and shapes of a step's inputs: slots, lengths, a block table, flags, sampling floats, an
    empty tensor and a non-contiguous one."""
    table = torch.randint(0, 1000, (n, 7), generator=g, dtype=torch.int32)
    return [torch.randint(-1, 10**9, (n,), generator=g), torch.randint(0, 8192, (n + 1,), generator=g).int(),
            table, torch.rand(n, generator=g) > 0.5, torch.rand(n, generator=g), torch.empty(0, dtype=torch.long),
            table[:, ::2]]


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
