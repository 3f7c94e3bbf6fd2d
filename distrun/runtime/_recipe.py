"""Loading a recipe module from a file path, the way ``python recipe.py`` would see it."""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

from distrun.errors import RecipeError


def prepare_sys_path(path: str, args: tuple[str, ...]) -> None:
    """Make sibling modules importable and give the recipe its own argv."""
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:
        sys.path.insert(0, folder)
    sys.argv = [path, *args]


def load_module(path: str) -> ModuleType:
    name = "distrun_recipe_" + os.path.splitext(os.path.basename(path))[0].replace("-", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise RecipeError(f"{path}: cannot load as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
