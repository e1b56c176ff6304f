"""Demangling: C++ (Itanium, via cxxfilt) and Rust (legacy and v0, via rust-demangler).

Compiler suffixes: GCC's `.cold`, `.isra.N`, `.part.N`, `.constprop.N` are clone
suffixes the Itanium demangler prints as `[clone .cold]`. LLVM's ThinLTO promotion
suffix `.llvm.NNNN` (a hash) is stripped first: cxxfilt rejects some of them and the
hash means nothing to a reader. A name that does not demangle is returned as is.
"""

from __future__ import annotations

import functools
import re

import cxxfilt
import rust_demangler

_LLVM_SUFFIX = re.compile(r"\.llvm\.\d+$")
# Rust legacy names are Itanium-mangled paths ending in a 17h<16 hex>E hash segment.
_RUST_LEGACY = re.compile(r"^_ZN.*17h[0-9a-f]{16}E")


@functools.lru_cache(maxsize=1 << 18)
def demangle(name: str) -> str:
    """The human-readable form of a (possibly) mangled symbol name."""
    base = _LLVM_SUFFIX.sub("", name)
    if base.startswith("_R") or _RUST_LEGACY.match(base):
        try:
            return str(rust_demangler.demangle(base))
        except Exception:  # noqa: BLE001 - the library raises bare Exceptions on bad input
            pass
    if base.startswith("_Z"):
        try:
            return str(cxxfilt.demangle(base, external_only=False))
        except cxxfilt.InvalidName:
            return base
    return base
