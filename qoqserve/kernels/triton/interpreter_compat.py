"""Keeps Triton's CPU interpreter usable with NumPy >= 2.4.

triton 3.6's interpreter turns a tensor into a Python int with
`int(handle.data)`, but scalar kernel arguments are 1-element 1-D arrays and
NumPy 2.4 refuses that conversion, so any `range(0, K, BK)` over an argument
fails (triton-lang/triton#9171, fixed upstream by taking the element first).
We apply the same fix from outside, only when the interpreter is on; compiled
kernels never go through this code.
"""
from __future__ import annotations

_done = False


def patch_interpreter() -> None:
    global _done
    if _done:
        return
    _done = True
    # lazy: patched only when the interpreter runs
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
