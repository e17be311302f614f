"""Patch a module as it is imported: the hooks' shared finder (``tests/hooks/sitecustomize.py``)."""

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable


def patch_on_import(patches: dict[str, Callable]) -> None:
    """When a module named in ``patches`` is imported, find it as the other finders do, run its code, then call
    ``patches[name](module)``."""

    class _PatchOnImport(importlib.abc.MetaPathFinder):
        busy = False

        def find_spec(self, name, path, target=None):
            if name not in patches or self.busy:
                return None
            self.busy = True  # the search below must not find this finder again
            try:
                spec = importlib.util.find_spec(name)
            finally:
                self.busy = False
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                patches[name](module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _PatchOnImport())
