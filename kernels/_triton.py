"""Optional Triton: one place that knows whether Triton kernels can run, and on which tensors.

Kernel modules import `triton`, `tl` and `jit` from here, so they import (and their plain-torch paths run)
on machines without Triton. Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when the kernel
module is first imported: a process that wants the CPU interpreter sets it before importing kernels.
Test: pytest tests/kernels (the interpreter tests run in a subprocess with TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # Triton is Linux-only; the reference paths need nothing from it.
    triton = None
    HAS_TRITON = False

    class _MissingLanguage:
        """Stands in for triton.language so that kernel signatures (`X: tl.constexpr`) still evaluate."""

        def __getattr__(self, name: str) -> object:
            return None

    tl = _MissingLanguage()

IMPLS = ("auto", "triton", "reference")


def jit(fn: Callable) -> Callable:
    """triton.jit when Triton is installed; otherwise a stub that says why it cannot run."""
    if HAS_TRITON:
        return triton.jit(fn)

    def unavailable(*args: object, **kwargs: object) -> None:
        raise RuntimeError(f"{fn.__name__}: Triton is not installed")

    return unavailable


def interpreting() -> bool:
    """Whether Triton kernels in this process run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def use_triton(impl: str, device: torch.device, what: str) -> bool:
    """Resolve an `impl` argument: "auto" picks Triton on CUDA, "triton" insists (raising a ValueError
    that names what is missing), "reference" never uses Triton."""
    if impl not in IMPLS:
        raise ValueError(f"{what}: impl must be one of {IMPLS}, got {impl!r}")
    if impl == "reference":
        return False
    usable = HAS_TRITON and (device.type == "cuda" or interpreting())
    if impl == "triton" and not usable:
        reason = "Triton is not installed" if not HAS_TRITON else (
            f"tensors are on {device.type}; Triton needs CUDA, or TRITON_INTERPRET=1 set before "
            "importing kernels to run on the CPU")
        raise ValueError(f"{what}: impl='triton' cannot run: {reason}")
    return usable if impl == "triton" else (usable and device.type == "cuda")
