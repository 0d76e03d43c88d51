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
