"""Run a command with some ``torch.*`` modules served from a patched source tree.

    python upstream_patches/_overlay.py ROOT -m pytest test_x.py

ROOT mirrors the PyTorch repo (``ROOT/torch/nn/functional.py`` ...). Every
``torch.*`` module whose file exists under ROOT is loaded from there; the rest of
torch comes from the installed wheel. Nothing is copied into site-packages.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import runpy
import sys


class PatchedTorchFinder(importlib.abc.MetaPathFinder):
    """Serves ``torch.x.y`` from ``ROOT/torch/x/y.py`` when that file exists."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.served: list[str] = []

    def find_spec(self, fullname, path=None, target=None):  # type: ignore[no-untyped-def]
        if not fullname.startswith("torch."):
            return None
        # only plain modules: packages (__init__.py) keep the wheel's search path
        candidate = os.path.join(self.root, *fullname.split(".")) + ".py"
        if not os.path.isfile(candidate):
            return None
        self.served.append(fullname)
        return importlib.util.spec_from_file_location(fullname, candidate)


def install(root: str) -> PatchedTorchFinder:
    if "torch" in sys.modules:
        raise RuntimeError("overlay: torch was imported before the overlay was installed")
    finder = PatchedTorchFinder(root)
    sys.meta_path.insert(0, finder)
    return finder


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "-m":
        raise SystemExit("usage: _overlay.py ROOT -m MODULE [ARGS...]")
    install(argv[0])
    sys.path[0] = os.getcwd()  # as `python -m`: the cwd, not this script's folder
    sys.argv = [argv[2], *argv[3:]]
    runpy.run_module(argv[2], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
