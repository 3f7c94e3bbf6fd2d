"""A job in a file: `distrun train RECIPE --config job.yaml`, and a cluster file's `job:` section.

The options of `distrun train` fall into sections, and the same sections are the panels of
its `--help`, the sections of a job file, and the sections `--print-config` writes. Within a
section a key is the flag's name without the section's word, so a user can guess it:
``--checkpoint-dir`` is ``checkpoint: {dir: ...}``, ``--steps`` is ``training: {steps: ...}``,
``--strategy`` is ``strategy: {name: ...}``.

This module owns the table and reads a file into options, by the name of the `train`
parameter each key sets; it checks names (a misspelt key gets the nearest one, and a key that
lives in another section is pointed there), never values: the command's own parameter types
convert those, so a file and a flag mean the same (``cli/_job_file``). Each option keeps the
``file:line`` it came from, for errors.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from distrun.config._yaml import Located, load_file, load_located

__all__ = ["Section", "SECTIONS", "OUTPUT_PANEL", "JobOption", "read_job_file", "parse_job_text", "job_options",
           "panel_of", "place_of"]


@dataclass(frozen=True)
class Section:
    """One section of a job file: its name there, its help panel, and ``key -> train parameter``."""

    name: str
    panel: str
    keys: Mapping[str, str]


def _section(name: str, panel: str, keys: dict[str, str]) -> Section:
    return Section(name, panel, MappingProxyType(keys))


#: Every option of `distrun train` that describes the job, by section, in the order the help shows them.
SECTIONS: tuple[Section, ...] = (
    _section("strategy", "Strategy", {"name": "strategy", "replicas": "replicas", "device": "device",
                                      "elastic": "elastic", "sync_batch_norm": "sync_batch_norm",
                                      "embeddings": "embeddings", "auto_approximate": "auto_approximate"}),
    _section("training", "Data and steps", {"steps": "steps", "epochs": "epochs",
                                            "global_batch_size": "global_batch_size", "seed": "seed",
                                            "data_workers": "data_workers", "accumulate": "accumulate",
                                            "eval_every": "eval_every",
                                            "clip_grad_norm": "clip_grad_norm", "on_nonfinite": "on_nonfinite",
                                            "args": "recipe_args"}),
    _section("precision", "Precision and compile", {"name": "precision", "compile": "compile_model",
                                                    "compile_mode": "compile_mode"}),
    _section("checkpoint", "Checkpoints", {"dir": "checkpoint_dir", "every": "checkpoint_every",
                                           "keep": "keep_checkpoints", "resume": "resume",
                                           "async": "async_checkpoint"}),
    _section("communication", "Communication", {"compression": "compression", "powersgd_warmup": "powersgd_warmup",
                                                "allreduce": "allreduce"}),
    _section("diloco", "Slow links (--strategy diloco)", {"sync_every": "sync_every", "outer_lr": "outer_lr",
                                                          "outer_momentum": "outer_momentum",
                                                          "sync_dtype": "sync_dtype", "fragments": "fragments"}),
    _section("ps", "Parameter server", {"tasks": "ps_tasks", "sync": "ps_sync", "max_staleness": "max_staleness",
                                       "partition_mb": "ps_partition_mb"}),
    _section("sharding", "Sharding and parallelism", {"within": "shard_within",
                                                      "reshard_after_forward": "reshard_after_forward",
                                                      "offload": "offload"}),
    _section("parallel", "Sharding and parallelism", {"tp": "tp", "sequence_parallel": "sequence_parallel",
                                                      "loss_parallel": "loss_parallel",
                                                      "pp": "pp", "pp_schedule": "pp_schedule",
                                                      "microbatches": "microbatches",
                                                      "activation_checkpointing": "activation_checkpointing"}),
    _section("observe", "Observability", {"tensorboard": "tensorboard", "profile": "profile", "tracker": "tracker",
                                          "tracker_uri": "tracker_uri", "run_name": "run_name",
                                          "experiment": "experiment", "tracker_checkpoint": "tracker_checkpoint",
                                          "hang_timeout_s": "hang_timeout_s", "log_interval_s": "log_interval_s"}),
    _section("cluster", "Cluster", {"file": "cluster_file", "include": "include", "detach": "detach",
                                    "max_restarts": "max_restarts", "results_dir": "results_dir", "fetch": "fetch",
                                    "cold": "cold", "requirements": "requirements", "allow_skew": "allow_skew"}),
)

#: The panel of the options that say how to run the command, not what the job is (not in a file).
OUTPUT_PANEL = "Output"

_BY_NAME = {section.name: section for section in SECTIONS}
_PLACE = {param: (section.name, key) for section in SECTIONS for key, param in section.keys.items()}


def panel_of(param: str) -> str:
    """The help panel of a `train` parameter (``OUTPUT_PANEL`` for those no file sets)."""
    place = _PLACE.get(param)
    return _BY_NAME[place[0]].panel if place else OUTPUT_PANEL


def place_of(param: str) -> str | None:
    """``section.key`` of a `train` parameter in a job file, or None (not in a file)."""
    place = _PLACE.get(param)
    return f"{place[0]}.{place[1]}" if place else None


@dataclass(frozen=True)
class JobOption:
    """One option a file sets: the `train` parameter, ``section.key`` as written, its raw value
    (YAML's), and ``file:line``."""

    param: str
    key: str
    value: Any
    where: str


def read_job_file(path: Path) -> tuple[JobOption, ...]:
    """The options of a job file (``--config``); a ConfigError names its file, line and key."""
    return job_options(load_file(path))


def parse_job_text(text: str, source: str) -> tuple[JobOption, ...]:
    return job_options(load_located(text, source))


def job_options(doc: Located, root: str = "") -> tuple[JobOption, ...]:
    """The options under ``root`` of ``doc`` (a job file: ""; a cluster file: "job")."""
    top = doc.value
    for part in root.split(".") if root else ():
        top = top.get(part) if isinstance(top, dict) else None
    if top is None:
        return ()
    if not isinstance(top, dict):
        raise doc.error(root, f"must be a mapping of sections ({', '.join(s.name for s in SECTIONS)})")
    found: list[JobOption] = []
    for name, body in top.items():
        path = f"{root}.{name}" if root else str(name)
        section = _BY_NAME.get(str(name))
        if section is None:
            raise doc.error(path, f"no such section{_elsewhere(str(name), None)}; sections: "
                                  f"{', '.join(s.name for s in SECTIONS)}")
        if body is None:
            continue
        if not isinstance(body, dict):
            example = next(iter(section.keys))
            raise doc.error(path, f"must be a mapping of keys ({name}: {{{example}: ...}}). Received: {body!r}")
        for key, value in body.items():
            normal = str(key).replace("-", "_")
            param = section.keys.get(normal)
            if param is None:
                raise doc.error(f"{path}.{key}", f"no such key{_elsewhere(normal, section)}; keys of {name}: "
                                                 f"{', '.join(section.keys)}")
            found.append(JobOption(param, f"{name}.{normal}", value, doc.where(f"{path}.{key}")))
    return tuple(found)


def _elsewhere(name: str, section: Section | None) -> str:
    """`` (did you mean checkpoint.dir?)``: the key's home when it is another section's (or a flag's
    whole name, ``checkpoint_dir``), else the nearest key of this section (or section)."""
    for param, (home, key) in _PLACE.items():
        words = {key, param, f"{home}_{key}", f"{key}_{home}", param.replace("_", "")}
        if name in words and (section is None or home != section.name):
            return f" (did you mean {home}.{key}?)"
    pool = list(section.keys) if section is not None else [s.name for s in SECTIONS]
    near = difflib.get_close_matches(name, pool, n=1, cutoff=0.6)
    if near:
        return f" (did you mean {section.name + '.' if section else ''}{near[0]}?)"
    keys = difflib.get_close_matches(name, list(_PLACE), n=1, cutoff=0.75)  # a flag's name, misspelt
    if keys:
        home, key = _PLACE[keys[0]]
        return f" (did you mean {home}.{key}?)"
    return ""
