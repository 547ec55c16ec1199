"""Faster @triton.jit helper calls in Triton's CPU interpreter, for the tests.

The interpreter makes triton.language's builtins interpretable by patching its modules
(`interpreter._patch_lang`): once when a kernel launches (undone after it), and again at every call of
a @triton.jit helper inside the kernel (`tl.sum`, the kernels' own helpers), each time walking the
modules' members. The helper calls' patches are never undone, so within one launch a second patch of
the same modules changes nothing. `install()` skips those repeats: a helper call whose modules this
launch has already patched runs without patching them again. The results are the same; the kernel tests
run faster (docs/BENCHMARKS.md, "Helper calls in the interpreter").

It installs only where the interpreter has the structure above (checked: Triton 3.6.0 and 3.9.0); elsewhere
the interpreter runs unchanged.
"""

from __future__ import annotations

import inspect
import os


def install() -> bool:
    """Whether the skip is installed (now or before) in this process: only where TRITON_INTERPRET=1."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang", None)
    if original is None:
        return False
    if getattr(original, "skips_repeats", False):
        return True
    try:
        helper_call = inspect.getsource(interpreter.InterpretedFunction.__call__)
        launch = inspect.getsource(interpreter.GridExecutor.__call__)
    except (AttributeError, OSError, TypeError):
        return False
    # a helper call patches and never restores; a launch patches, then restores in a `finally`
    if "_patch_lang(self.fn)" not in helper_call or "restore" in helper_call or ".restore()" not in launch:
        return False
    patched = []  # per launch in progress: the modules patched so far (ids)

    class _Repeat:
        def restore(self) -> None:
            pass

    class _Launch:
        def __init__(self, scope):
            self.scope = scope

        def restore(self) -> None:
            patched.pop()
            self.scope.restore()

    def patch_lang(fn):
        langs = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
        if patched and langs <= patched[-1]:
            return _Repeat()
        scope = original(fn)
        if patched:  # a helper call: its patch stays for the rest of the launch
            patched[-1] |= langs
            return scope
        patched.append(langs)  # a launch
        return _Launch(scope)

    patch_lang.skips_repeats = True
    interpreter._patch_lang = patch_lang
    return True
