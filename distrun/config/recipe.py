"""Recipe inspection without running the recipe.

A recipe is one of three kinds (docs/recipes.md). Telling them apart must not
execute the file: a plain torchrun script trains as a side effect of being run.
So the file is parsed (``ast``) and classified from its top-level definitions;
this is also how a syntax error or a half-written fit-style recipe is reported
in a fraction of a second, before any process starts.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Any

from distrun.config._suggest import did_you_mean
from distrun.errors import RecipeError

__all__ = ["RecipeKind", "RecipeInfo", "inspect_recipe", "FIT_REQUIRED", "FIT_OPTIONAL", "DEFAULT_KEYS"]

FIT_REQUIRED = ("model", "optimizer", "loss", "train_data")
FIT_OPTIONAL = ("eval_data", "metrics", "forward")
#: Keys a recipe's module-level ``defaults`` dict may set; CLI flags override them.
DEFAULT_KEYS = ("global_batch_size", "epochs", "steps", "seed", "checkpoint_every")

_SIGNATURES = {
    "model": "model()",
    "optimizer": "optimizer(params)",
    "loss": "loss(outputs, batch)",
    "train_data": "train_data(ctx)",
}


class RecipeKind(str, Enum):
    FIT = "fit"
    CUSTOM_LOOP = "custom-loop"
    SCRIPT = "script"


@dataclass(frozen=True)
class RecipeInfo:
    path: str
    kind: RecipeKind
    defaults: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    functions: frozenset[str] = frozenset()  # top-level function names (eval_data, metrics, ...)
    #: Module-level ``include = [...]``: files and folders, relative to the recipe, that go into
    #: the code bundle with it (as ``--include`` does): the data a recipe reads beside itself.
    include: tuple[str, ...] = ()


def inspect_recipe(path: str) -> RecipeInfo:
    """Classify the recipe at ``path``; raise RecipeError naming file:line on a problem."""
    display = os.path.basename(path)
    try:
        with open(path, "rb") as fh:
            source = fh.read()
    except OSError as exc:
        raise RecipeError(f"{path}: cannot read recipe: {exc.strerror}") from None
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as exc:
        raise RecipeError(f"{path}:{exc.lineno}: syntax error: {exc.msg}") from None
    except (ValueError, RecursionError, MemoryError) as exc:  # null bytes; nesting past the parser's limits
        raise RecipeError(f"{path}: cannot parse the recipe: {str(exc) or type(exc).__name__}") from None

    functions: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}
    defaults_node: ast.expr | None = None
    include: tuple[str, ...] = ()
    has_main_guard = False
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions[node.name] = node
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "defaults" for t in node.targets
        ):
            defaults_node = node.value
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and _assigns(node, "include") and node.value is not None:
            include = _include(path, node.value)
        elif isinstance(node, ast.If) and _is_main_guard(node.test):
            has_main_guard = True

    main = functions.get("main")
    if main is not None and _required_positional(main) == 1:
        return RecipeInfo(path, RecipeKind.CUSTOM_LOOP, _defaults(path, defaults_node), frozenset(functions),
                          include)

    present = [name for name in FIT_REQUIRED if name in functions]
    if len(present) == len(FIT_REQUIRED):
        return RecipeInfo(path, RecipeKind.FIT, _defaults(path, defaults_node), frozenset(functions), include)
    if present and not has_main_guard:
        first = functions[present[0]]
        missing = ", ".join(_SIGNATURES[n] for n in FIT_REQUIRED if n not in functions)
        raise RecipeError(
            f"{path}:{first.lineno}: {display} defines {', '.join(p + '()' for p in present)} "
            f"but lacks {missing}: a fit-style recipe needs all of "
            f"{', '.join(_SIGNATURES[n] for n in FIT_REQUIRED)}"
        )
    return RecipeInfo(path, RecipeKind.SCRIPT, MappingProxyType({}), frozenset(functions), include)


def _required_positional(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    args = fn.args
    positional = len(args.posonlyargs) + len(args.args)
    return positional - len(args.defaults)


def _is_main_guard(test: ast.expr) -> bool:
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators)
    )


def _assigns(node: ast.Assign | ast.AnnAssign, name: str) -> bool:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return any(isinstance(target, ast.Name) and target.id == name for target in targets)


def _include(path: str, node: ast.expr) -> tuple[str, ...]:
    """``include = ["data/shakespeare.txt", "vocab/"]``: literal relative paths inside the recipe's folder.

    Only a literal list (or tuple) of strings is distrun's: a script's own ``include`` variable
    (``include = sys.argv[1:]``, a number) is the script's business and is left alone."""
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return ()
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        return ()
    for item in value:
        parts = item.replace("\\", "/").split("/")
        if not item or item.startswith("/") or ".." in parts:
            raise RecipeError(f"{path}:{node.lineno}: include {item!r}: must be a path inside the recipe's folder, "
                              "relative to it (no leading /, no ..)")
    return tuple(value)


def _defaults(path: str, node: ast.expr | None) -> Mapping[str, Any]:
    if node is None:
        return MappingProxyType({})
    try:
        value = ast.literal_eval(node)
    except ValueError:
        raise RecipeError(f"{path}:{node.lineno}: `defaults` must be a literal dict") from None
    if not isinstance(value, dict):
        raise RecipeError(f"{path}:{node.lineno}: `defaults` must be a dict. Received: {type(value).__name__}")
    for key, item in value.items():
        if key not in DEFAULT_KEYS:
            raise RecipeError(
                f"{path}:{node.lineno}: defaults[{key!r}] is not a known key{did_you_mean(str(key), DEFAULT_KEYS)}; "
                f"known: {', '.join(DEFAULT_KEYS)}"
            )
        minimum = 0 if key == "seed" else 1
        if not isinstance(item, int) or isinstance(item, bool) or item < minimum:
            raise RecipeError(f"{path}:{node.lineno}: defaults[{key!r}] must be a positive whole number. Received: {item!r}")
    return MappingProxyType(value)
