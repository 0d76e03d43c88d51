"""The kernels' `do_not_specialize` / `do_not_specialize_on_alignment` lists name parameters of their kernel: Triton
ignores a name it does not know, so a typo would silently bring back a compilation while serving
(docs/architecture.md, kernels/)."""

from __future__ import annotations

import inspect

from tests.kernel_utils import launched_kernels


def test_unspecialized_names_are_parameters():
    seen = 0
    for fn in launched_kernels():
        params = list(inspect.signature(fn.fn).parameters)
        opts = getattr(fn, "kwargs", None) or vars(fn)
        for key in ("do_not_specialize", "do_not_specialize_on_alignment"):
            for entry in opts.get(key) or ():
                seen += 1
                assert entry in params or (isinstance(entry, int) and entry < len(params)), (
                    f"{fn.fn.__name__}: {key} names {entry!r}, not a parameter"
                )
    assert seen >= 20  # the lists are where the hook looks for them


def test_work_beside_the_step_launches_without_pdl(monkeypatch):
    """kernels/pdl.py: a PDL-capable device launches with PDL except inside `beside_the_step` (side-stream work),
    nested or not, and again after it."""
    import torch

    from sparseserve.kernels import pdl

    monkeypatch.setattr(pdl, "ENABLED", True)
    monkeypatch.setattr(pdl, "_capable", lambda device: True)
    dev = torch.device("cuda", 0)
    assert pdl.use_pdl(dev)
    with pdl.beside_the_step():
        assert not pdl.use_pdl(dev)
        with pdl.beside_the_step():
            assert not pdl.use_pdl(dev)
        assert not pdl.use_pdl(dev)
    assert pdl.use_pdl(dev)
