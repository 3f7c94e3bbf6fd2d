"""Skew and missing packages, named before any rank of a cluster job starts (issue 49, item 4).

A rank that imports a package its host lacks, or another version of it than the client's,
fails seconds in, once per rank, as a traceback; and a torch that differs between hosts
can fail much later, inside a collective. So before the job is submitted every host's
ranks' interpreter (its server's, with the job's own layer first: ``client/_job_env``) is
asked what it would import, by the same stdlib-only script that finds environments
(``_env_host.py inspect``: nothing is imported there, torch's CUDA build is read from
``torch/version.py``), and compared with the client's. The job is refused in one line
(HostError, exit 6) when, on any host:

- the Python minor version differs from the client's;
- torch's version differs from the client's, or it was built without CUDA and the job
  runs on the host's GPUs;
- a package the recipe imports at module level (``ast``, on the client) is not found, or
  has another version than the client's where the client has it too;
- a package the job's options need (``--tensorboard``, ``--tracker mlflow|wandb``) is not found.

``--allow-skew`` lets versions differ (a missing package would fail anyway: never allowed).
"""

from __future__ import annotations

import ast
import json
import sys
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distrun.client import _env_host
from distrun.client._environment import host_script
from distrun.client._links import HostLink
from distrun.config import JobSpec
from distrun.errors import HostError, RecipeError

__all__ = ["HostFacts", "recipe_imports", "option_packages", "check_hosts", "host_facts", "client_facts",
           "ranks_python"]

#: The packages an option imports in the ranks (import name), and the flag that asks for it.
_OPTION_PACKAGES = {"tensorboard": "--tensorboard", "mlflow": "--tracker mlflow", "wandb": "--tracker wandb"}
#: Checked apart (the server's own version is checked on every connection), or never a package.
_NOT_PACKAGES = frozenset({"__future__", "distrun", "torch"})
#: In a host's state folder: the interpreter `up` started its server with (``client/cluster``).
_INTERPRETER_FILE = "interpreter"


@dataclass(frozen=True)
class HostFacts:
    """What one interpreter would import: ``inspect``'s answer, for a host or the client."""

    python: str  # major.minor
    python_full: str
    modules: dict[str, dict[str, Any]]  # import name -> {"found", "dist", "version"[, "cuda"]}

    @classmethod
    def of(cls, said: dict[str, Any]) -> HostFacts:
        return cls(str(said["python"]), str(said.get("python_full") or said["python"]), dict(said["modules"]))

    def found(self, module: str) -> bool:
        return bool(self.modules.get(module, {}).get("found"))

    def version(self, module: str) -> str | None:
        value = self.modules.get(module, {}).get("version")
        return str(value) if value else None

    @property
    def torch_cuda(self) -> str | None:
        """torch's CUDA version ('' when built without it; None when unknown)."""
        value = self.modules.get("torch", {}).get("cuda")
        return None if value is None else str(value)


def recipe_imports(recipe: str, shipped: Iterable[str] = ()) -> tuple[str, ...]:
    """The top-level packages the recipe imports at module level, less the standard library and
    what the bundle ships beside it (``shipped``: paths inside the bundle)."""
    try:
        tree = ast.parse(Path(recipe).read_text(encoding="utf-8"), filename=recipe)
    except (OSError, SyntaxError, ValueError) as exc:
        raise RecipeError(f"{recipe}: cannot read its imports: {exc}") from None
    local = {Path(path).parts[0].removesuffix(".py") for path in shipped if Path(path).parts}
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module.split(".")[0])
    skip = local | set(sys.stdlib_module_names) | _NOT_PACKAGES
    return tuple(dict.fromkeys(name for name in names if name not in skip))


def option_packages(spec: JobSpec) -> dict[str, str]:
    """The packages ``spec``'s options import in the ranks: import name -> the flag that needs it."""
    wanted = ["tensorboard"] if spec.observe.tensorboard_dir else []
    wanted += [name for name in spec.observe.trackers if name in _OPTION_PACKAGES]
    return {name: _OPTION_PACKAGES[name] for name in wanted}


def client_facts(modules: Iterable[str]) -> HostFacts:
    return HostFacts.of(_env_host.inspect_modules(list(modules)))


def ranks_python(link: HostLink) -> str:
    """The interpreter the host's ranks run: the one `up` started its server with."""
    try:
        recorded = (link.remote.read_file(f"{link.state_dir}/{_INTERPRETER_FILE}") or "").strip()
    except HostError:
        recorded = ""
    return recorded if recorded and "\n" not in recorded else link.host.python


def host_facts(link: HostLink, modules: Iterable[str], path: Iterable[str] = (),
               python: str | None = None) -> HostFacts:
    """``inspect`` on the host, with its ranks' interpreter and ``path`` (the job's layer) first."""
    python = python or ranks_python(link)
    config = {"modules": list(modules), "path": list(path)}
    result = link.remote.run([python, "-c", host_script(), "inspect"], stdin=json.dumps(config), timeout_s=60.0)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    try:
        return HostFacts.of(json.loads(lines[-1]))
    except (IndexError, ValueError, KeyError, TypeError, RecursionError):
        raise HostError(link.label, f"could not ask {python} what the ranks would import: "
                                    f"{result.last_line() or 'no answer'}") from None


def _public(version: str | None) -> str | None:
    """A version without its local label: torch 2.13.0+cpu and 2.13.0+cu124 are one release."""
    return version.split("+", 1)[0] if version else None


def problems_of(label: str, host: HostFacts, client: HostFacts, *, modules: Iterable[str],
                options: dict[str, str], cuda_wanted: bool, gpus: int, allow_skew: bool) -> list[str]:
    """Each problem as its one line, the host first."""
    found: list[str] = []
    if host.python != client.python and not allow_skew:
        found.append(f"{label}: Python {host.python_full} where the client has {client.python_full} (set python: "
                     f"to a Python {client.python} there, or --allow-skew)")
    torch_here = _public(client.version("torch"))
    if client.found("torch") and not host.found("torch"):
        found.append(f"{label}: torch is not installed there (add torch=={torch_here} to requirements)")
    elif torch_here and _public(host.version("torch")) not in (None, torch_here) and not allow_skew:
        found.append(f"{label}: torch {_public(host.version('torch'))} where the client has {torch_here} "
                     f"(add torch=={torch_here} to requirements, or --allow-skew)")
    if cuda_wanted and gpus and host.found("torch") and host.torch_cuda == "" and not allow_skew:
        found.append(f"{label}: torch {host.version('torch')} was built without CUDA, and the job runs on the "
                     f"host's {gpus} GPU(s) (install a CUDA build of torch there, or --allow-skew)")
    for module in modules:
        if not host.found(module):
            found.append(f"{label}: the recipe imports {module}, which is not installed there (add it to requirements)")
            continue
        theirs, ours = _public(host.version(module)), _public(client.version(module))
        if theirs and ours and theirs != ours and not allow_skew:
            dist = client.modules.get(module, {}).get("dist") or module
            found.append(f"{label}: {dist} {theirs} where the client has {ours} (add {dist}=={ours} to "
                         "requirements, or --allow-skew)")
    for module, flag in options.items():
        if not host.found(module):
            found.append(f"{label}: {flag} needs {module}, which is not installed there (add it to requirements)")
    return found


def check_hosts(links: list[HostLink], spec: JobSpec, shipped: Iterable[str], *, allow_skew: bool = False,
                layers: dict[str, tuple[str, str]] | None = None) -> None:
    """Refuse the job (HostError, one line) if any host would fail it for its environment.

    ``layers``: per host label, (its ranks' python, the job's layer folder), from ``client/_job_env``.
    """
    modules = recipe_imports(spec.recipe, shipped)
    options = option_packages(spec)
    asked = list(modules) + [name for name in options if name not in modules]
    client = client_facts(asked)
    cuda_wanted = spec.strategy.device == "cuda"
    layers = layers or {}

    def one(link: HostLink) -> list[str]:
        python, layer = layers.get(link.label, (None, None))
        host = host_facts(link, asked, [layer] if layer else (), python)
        gpus = link.info.gpu_count if link.info is not None else 0
        return problems_of(link.label, host, client, modules=modules, options=options, cuda_wanted=cuda_wanted,
                           gpus=gpus, allow_skew=allow_skew)

    if not links:
        return
    with ThreadPoolExecutor(max_workers=min(32, len(links))) as pool:
        found = [line for lines in pool.map(one, links) for line in lines]
    if found:
        raise _one_line(found)


def _one_line(found: list[str]) -> HostError:
    """Every problem in one line: hosts with the same problem named together, the first problem first."""
    hosts: dict[str, list[str]] = {}
    for line in found:
        label, _, reason = line.partition(": ")
        hosts.setdefault(reason, []).append(label)
    (reason, labels), *others = hosts.items()
    more = "; ".join(f"{', '.join(where)}: {why}" for why, where in others)
    return HostError(", ".join(labels), reason + (f"; and {more}" if more else ""))
