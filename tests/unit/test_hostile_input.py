"""Hostile input, round 2: every parser of outside input ends in distrun's own error (or success),
in bounded time, whatever it is fed.

Known shapes first (an alias bomb, deep nesting, an oversized file), then Hypothesis
fuzzing of each parser. ``DISTRUN_FUZZ_EXAMPLES`` raises the examples per parser for a
deep search (CI runs the default).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import string
import struct
import tarfile
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distrun.config import parse_cluster
from distrun.config._yaml import MAX_DEPTH, MAX_FILE_BYTES, MAX_VALUES
from distrun.config.recipe import inspect_recipe
from distrun.errors import ConfigError, DistrunError, RecipeError
from distrun.protocol import EventDecodeError, decode_event
from distrun.protocol.wire import MAX_AUTH_FRAME_BYTES, WireError, recv_frame
from distrun.server._bundle import BundleError, unpack

EXAMPLES = int(os.environ.get("DISTRUN_FUZZ_EXAMPLES", "200"))
#: Each example gets this long (a hang or a blow-up fails it); a real cluster file parses in milliseconds.
DEADLINE_MS = 2000
FUZZ = settings(max_examples=EXAMPLES, deadline=DEADLINE_MS,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
#: The hostile files must fail within this (their old cost: over 60 s and 4.6 GB, or a RecursionError).
BOUND_S = 5.0


def _refused_quickly(text: str, fragment: str) -> str:
    start = time.monotonic()
    with pytest.raises(ConfigError) as caught:
        parse_cluster(text, "hostile.yaml")
    assert time.monotonic() - start < BOUND_S
    message = str(caught.value)
    assert message.startswith("hostile.yaml") and fragment in message and "\n" not in message, message
    return message


def test_an_alias_bomb_is_refused_at_the_value_bound() -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    text = "\n".join([*lines, "hosts: *a8"]) + "\n"
    assert len(text) < 1000  # 9^8 leaves from under a kilobyte
    _refused_quickly(text, f"expands to more than {MAX_VALUES:,} values")


@pytest.mark.parametrize(
    "text",
    ["hosts: " + "[" * 5000 + "]" * 5000 + "\n", "hosts: " + "{a: " * 3000 + "1" + "}" * 3000 + "\n",
     "".join(f"{'  ' * i}k{i}:\n" for i in range(200)) + "  " * 200 + "v\n"],
    ids=["flow-sequences", "flow-mappings", "block-mappings"],
)
def test_deep_nesting_is_refused_with_its_line(text: str) -> None:
    _refused_quickly(text, f"nested deeper than {MAX_DEPTH} levels")


def test_an_oversized_file_is_refused_before_parsing() -> None:
    _refused_quickly("# " + "x" * MAX_FILE_BYTES + "\n", "a cluster file is at most")


def test_aliases_that_share_settings_still_work() -> None:
    spec = parse_cluster("ssh: {user: alice}\n"
                         "hosts:\n"
                         "  - &gpu {address: gpu-1, roles: [chief, worker], slots: 2}\n"
                         "  - {<<: *gpu, address: gpu-2, roles: [worker]}\n", "shared.yaml")
    assert [(h.address, h.slots) for h in spec.hosts] == [("gpu-1", 2), ("gpu-2", 2)]


# -- fuzzing: the cluster file loader

_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=True),
                     st.text(max_size=30))
_KEYS = st.sampled_from(["name", "hosts", "ssh", "address", "roles", "slots", "gpus", "user", "port", "python",
                         "workdir", "setup", "env", "network", "identity_file", "known_hosts", "chief", "worker",
                         "ps", "evaluator", "interface", "port_range", "connect_timeout_s", "<<"]) | st.text(max_size=8)
_DOCS = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(_KEYS, inner, max_size=6),
                     max_leaves=40)


@FUZZ
@given(st.text(alphabet=st.sampled_from(string.printable + "&*!|>[]{}:-,#%@`\u00e9\u2028\x00"), max_size=400))
def test_fuzz_cluster_file_text(text: str) -> None:
    try:
        parse_cluster(text, "fuzz.yaml")
    except ConfigError:
        pass


@FUZZ
@given(_DOCS)
def test_fuzz_cluster_file_shapes(doc: object) -> None:
    """Well-formed YAML of the right keys in wrong shapes: the validator's paths, not the scanner's."""
    try:
        parse_cluster(yaml.safe_dump(doc, allow_unicode=True), "fuzz.yaml")
    except ConfigError:
        pass


# -- recipe classification (the client reads the user's file; a server reads a shipped one)

@FUZZ
@given(st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_fuzz_recipe_classification(tmp_path_factory: pytest.TempPathFactory, source: bytes) -> None:
    path = tmp_path_factory.mktemp("recipe") / "recipe.py"
    path.write_bytes(source)
    try:
        inspect_recipe(str(path))
    except RecipeError:
        pass


def test_a_recipe_nested_past_the_parser_is_a_recipe_error(tmp_path: Path) -> None:
    path = tmp_path / "deep.py"
    path.write_text("x = " + "-" * 200_000 + "1\n")  # past the compiler's recursion limit
    with pytest.raises(RecipeError):
        inspect_recipe(str(path))


# -- the control plane: frames before and after authentication

class _Bytes(io.BytesIO):
    def recv(self, size: int) -> bytes:
        return self.read(size)

    def sendall(self, data: bytes) -> None:
        pass


def _frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


_JSONISH = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=10),
                        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
                        max_leaves=20)


@FUZZ
@given(st.binary(max_size=600) | _JSONISH.map(lambda v: _frame(json.dumps(v).encode()))
       | st.integers(0, 2**32 - 1).map(lambda n: struct.pack(">I", n)))
def test_fuzz_frames_before_and_after_authentication(data: bytes) -> None:
    for limit in (MAX_AUTH_FRAME_BYTES, None):
        stream = _Bytes(data)
        try:
            message = recv_frame(stream, limit) if limit is not None else recv_frame(stream)
        except WireError:
            continue
        assert isinstance(message, dict)


def test_a_deeply_nested_frame_is_a_wire_error() -> None:
    with pytest.raises(WireError, match="nested too deeply"):
        recv_frame(_Bytes(_frame(b"[" * 200_000 + b"]" * 200_000)))


# -- event lines coming back from ranks

_EVENT_TYPES = st.sampled_from(["started", "step", "progress", "log", "eval", "checkpoint", "done", "failed",
                                "output", "exited", "heartbeat", "compile", "ps", "hung", "nope"])


@FUZZ
@given(st.binary(max_size=300)
       | st.builds(lambda kind, rest: json.dumps({"type": kind, **rest}).encode(), _EVENT_TYPES,
                   st.dictionaries(st.sampled_from(["rank", "time", "step", "loss", "line", "stream", "pid", "x"]),
                                   _JSONISH, max_size=5)))
def test_fuzz_event_lines(line: bytes) -> None:
    try:
        decode_event(line)
    except EventDecodeError:
        pass


def test_a_deeply_nested_event_line_is_a_decode_error() -> None:
    with pytest.raises(EventDecodeError, match="nested too deeply"):
        decode_event(b"[" * 100_000 + b"]" * 100_000)


def test_every_parser_error_is_a_distrun_error() -> None:
    for error in (ConfigError, RecipeError, WireError, EventDecodeError):
        assert issubclass(error, DistrunError)


# -- bundle unpacking (a server unpacks what a client ships)

_NAMES = st.lists(st.sampled_from(["a", "b", "..", ".", "", "/", "\\", "x.py", "\x00", "é"]), min_size=1,
                  max_size=4).map("/".join)
_MEMBERS = st.lists(st.tuples(_NAMES, st.sampled_from([tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE,
                                                       tarfile.LNKTYPE, tarfile.FIFOTYPE, tarfile.CHRTYPE]),
                              st.binary(max_size=20)), max_size=6)


def _tar_gz(members: list[tuple[str, bytes, bytes]]) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as tar:
        for name, kind, data in members:
            info = tarfile.TarInfo(name)
            info.type = kind
            info.linkname = "../../etc/passwd" if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE) else ""
            info.size = len(data) if kind == tarfile.REGTYPE else 0
            try:
                tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)
            except (ValueError, UnicodeError):
                continue  # a name tarfile itself cannot write
    return raw.getvalue()


@FUZZ
@given(st.binary(max_size=400) | _MEMBERS.map(_tar_gz)
       | _MEMBERS.map(_tar_gz).map(lambda data: data[: max(1, len(data) // 2)]))  # cut short
def test_fuzz_bundle_unpacking(tmp_path_factory: pytest.TempPathFactory, archive: bytes) -> None:
    root = tmp_path_factory.mktemp("bundle")
    path = root / "bundle.tar.gz"
    path.write_bytes(archive)
    dest = root / "bundles" / "b"
    try:
        unpack(path, hashlib.sha256(archive).hexdigest(), dest)
    except BundleError:
        assert not dest.exists()
        return
    for found in dest.rglob("*"):  # whatever was unpacked stays inside, with no link or device
        assert found.resolve().is_relative_to(dest.resolve()) and (found.is_file() or found.is_dir())
        assert not found.is_symlink()


# -- the handshake's fields, and the state files a client reads from a host

@FUZZ
@given(_JSONISH)
def test_fuzz_handshake_hello(hello: object) -> None:
    """Whatever a peer says first, the server's handshake ends in AuthError/WireError, never another
    exception (the token is random, so no example can pass it)."""
    from distrun.protocol.wire import AuthError, server_handshake

    stream = _Bytes(_frame(json.dumps(hello).encode()))
    with pytest.raises((AuthError, WireError)):
        server_handshake(stream, os.urandom(32))


@FUZZ
@given(st.text(max_size=300) | _JSONISH.map(json.dumps) | st.just("[" * 100_000))
def test_fuzz_a_hosts_state_file(text: str) -> None:
    """A state file read back from a host (SFTP) is a state, or None: `up` replaces it."""
    from distrun.client._links import read_server_state

    class _Remote:
        def read_file(self, path: str) -> str:
            return text

    state = read_server_state(_Remote(), "state")  # type: ignore[arg-type]
    assert state is None or text.lstrip().startswith("{")  # only a JSON object can describe a server


# -- authenticated requests: the server's dispatcher answers every one, and keeps serving

_OPS = st.sampled_from(["status", "warm", "has_bundle", "rendezvous", "submit", "cancel", "jobs", "artifacts",
                        "follow", "nope"]) | st.text(max_size=8) | _JSONISH
_ARGS = st.dictionaries(st.sampled_from(["job", "bundle", "recipe", "spec", "sha256", "port_range", "world_size",
                                         "rank_offset", "local_world_size", "offset", "reason", "x"]),
                        _JSONISH, max_size=5) | _JSONISH


@pytest.fixture(scope="module")
def worker_server(tmp_path_factory: pytest.TempPathFactory):
    from distrun.server._server import WorkerServer
    from distrun.server._state import StateDir

    state_dir = StateDir(tmp_path_factory.mktemp("server"))
    state_dir.create()
    server = WorkerServer(state_dir, config_sha256="0" * 64)
    server.bind()
    yield server
    server.jobs.stop_all("test over")


@FUZZ
@given(_OPS, _ARGS)
def test_fuzz_authenticated_requests(worker_server, op: object, args: object) -> None:
    reply = worker_server._dispatch({"id": 1, "op": op, "args": args})
    assert reply["id"] == 1 and isinstance(reply["ok"], bool)
    if not reply["ok"]:
        assert isinstance(reply["error"]["message"], str)
