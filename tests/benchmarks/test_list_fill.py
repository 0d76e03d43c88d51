"""benchmarks/list_fill.py on the CPU (the kernels under the Triton interpreter, float32, a tiny context, each call
made once instead of timed): every case and kernel attends what the reference does, in HBM and through an offload
view (pool slots and host rows); its times matter on a GPU only."""

from __future__ import annotations

import torch

from benchmarks import list_fill as bench
from sparseserve.kernels import sparse_decode


def test_every_fill_and_kernel_matches_the_reference(tmp_path):
    shapes = {"group4": (8, 2, 32, 200), "mha": (2, 2, 32, 200)}
    cases = ((16, 64, 64), (16, 32, 96), (16, 16, 96), (32, 64, 96))  # full, a third, a sixth, blocks of 32
    other = tmp_path / "other_sparse_decode.py"
    other.write_text(open(sparse_decode.__file__).read())  # "another tree's" kernels, loaded from a path
    kernels = {"this": sparse_decode, "other": bench.load_kernels(str(other))}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    timer = lambda call: (call(), 0.0)[1]  # noqa: E731
    rows = bench.measure(2, shapes, cases, kernels, timer, device, torch.float32, host_share=0.3)
    assert len(rows) == len(shapes) * len(cases) * 2 * 2 * 3
    assert {r["tree"] for r in rows} == {"this", "other"} and {r["pool"] for r in rows} == {"hbm", "pool"}
    assert all(r["err"] < 1e-4 for r in rows), [r for r in rows if not r["err"] < 1e-4]


def test_lists_hold_their_entries_first():
    q, cache, tables, seq_lens, sel, slots = bench.inputs(2, (4, 2, 16, 200), (16, 48, 96), "cpu", torch.float32)
    assert sel.shape == (2, 2, 6)
    assert (sel[..., :3] >= 0).all() and (sel[..., 3:] == -1).all()
    assert (sel[..., :3] < 200 // 16 + 1 - bench.LOCAL).all()  # before the window


def test_offload_view_serves_the_listed_blocks():
    """The view's pool slots and host rows hold each listed block's K/V (the reference reads them), and about
    host_share of the entries read from the host."""
    from sparseserve.kernels.sparse_decode import read_listed_ref

    q, cache, tables, seq_lens, sel, slots = bench.inputs(2, (4, 2, 16, 400), (16, 128, 256), "cpu", torch.float32)
    view = bench.offloaded(cache, tables, sel, host_share=0.5)
    listed = sel >= 0
    heads = torch.arange(2)[None, :, None]
    want = cache[tables.long().gather(1, sel.clamp_min(0).flatten(1).long()).view_as(sel), heads]
    assert torch.equal(read_listed_ref(view)[listed], want[listed])
    host = (view[2] < 0).float().mean().item()
    assert 0.3 < host < 0.7
