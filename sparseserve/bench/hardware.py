"""Hardware ceilings measured in the same run as a benchmark (ratios against them, never absolute times)."""

from __future__ import annotations

import torch


def _time_ms(fn, iters: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def hbm_bandwidth(nbytes: int = 4 << 30) -> float:
    """Bytes/s of a large device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms / 1e3)


def matmul_flops(n: int = 8192) -> float:
    """FLOP/s of a bf16 n x n x n matrix product on random data."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = _time_ms(lambda: a @ b)
    return 2 * n**3 / (ms / 1e3)


def print_table(rows: list[dict], title: str = "") -> None:
    if not rows:
        return
    cols = list(dict.fromkeys(k for r in rows for k in r))
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else "-" if v is None else str(v)  # noqa: E731
    widths = {c: max(len(c), *(len(fmt(r.get(c, ""))) for r in rows)) for c in cols}
    if title:
        print(f"\n{title}")
    print("  ".join(c.rjust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(fmt(r.get(c, "")).rjust(widths[c]) for c in cols))
