"""A checkpoint of another model, said in one line: the first keys and shapes that differ.

``load_state_dict`` raises a RuntimeError that lists every missing and unexpected key and
every size mismatch, one per line after "Error(s) in loading state_dict for GPT:". A user
who pointed ``--resume`` at the wrong folder needs the first few, not the dump.
"""

from __future__ import annotations

import re

__all__ = ["describe_mismatch"]

_HEADER = "Error(s) in loading state_dict"
_SIZE = re.compile(r"size mismatch for ([^:]+): copying a param with shape torch\.Size\(\[([^\]]*)\]\) from "
                   r"checkpoint, the shape in current model is torch\.Size\(\[([^\]]*)\]\)")
_KEYS = re.compile(r"(Missing|Unexpected) key\(s\) in state_dict: (.*)")
_SHOWN = 3


def describe_mismatch(exc: BaseException) -> str | None:
    """"size mismatch for 0.weight (checkpoint [16, 6], model [8, 6]); missing keys: head.bias" from
    torch's message, at most three of each; None when ``exc`` is not a state_dict mismatch."""
    text = str(exc)
    if _HEADER not in text:
        return None
    parts = []
    sizes = _SIZE.findall(text)
    if sizes:
        shown = [f"{key} (checkpoint [{saved}], model [{model}])" for key, saved, model in sizes[:_SHOWN]]
        parts.append("size mismatch for " + ", ".join(shown) + _more(len(sizes)))
    for kind, keys in _KEYS.findall(text):
        names = [name.strip().strip('"') for name in keys.rstrip(". ").split(",") if name.strip()]
        parts.append(f"{kind.lower()} keys: " + ", ".join(names[:_SHOWN]) + _more(len(names)))
    return "; ".join(parts) or text.split("\n", 1)[0]


def _more(count: int) -> str:
    return f" and {count - _SHOWN} more" if count > _SHOWN else ""
