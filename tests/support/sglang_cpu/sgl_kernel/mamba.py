"""sgl_kernel.mamba's CPU names, imported by SGLang's GDN backend at module import (tests
only; ../README.md). A forward pass through them is not stood in: each raises."""

from __future__ import annotations


def _not_stood_in(name: str):
    def fn(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.mamba.{name}: an import stand-in (tests/support/sglang_cpu); "
                                  "a forward pass through it needs the real CPU kernel")
    fn.__name__ = name
    return fn


causal_conv1d_fn_cpu = _not_stood_in("causal_conv1d_fn_cpu")
causal_conv1d_update_cpu = _not_stood_in("causal_conv1d_update_cpu")
