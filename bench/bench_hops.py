"""The data path of one Tinker ``forward_backward``: how many icefloe functions carry its data, and how
often its numbers change representation on the way.

The tinker SDK submits one ``forward_backward`` and polls it with ``retrieve_future`` (``.result()``)
against a real service in this process (``create_app`` on uvicorn in a thread, ``--engines local``
by default), after one unmeasured call that warms every lazy import. A profile hook on every thread
follows the op's data through the code:

* the DATA is the request body (as uvicorn hands it to the app; any bytes that are part of it, and
  every protobuf message parsed from it), and any object an earlier hop made from it: what a hop
  returns (walked into containers, dataclasses and protobuf messages), numpy or torch views of it;
* a HOP is a call of an icefloe function that receives the data as an argument (inside a container,
  a dataclass, a ``functools.partial`` or a closure it is handed) or returns it; distinct functions
  are counted, comprehensions and lambdas belonging to the function that encloses them;
* a CONVERSION is a hop that returns data it made in a representation none of its data arguments
  has (bytes, protobuf, numpy, torch on a device, a list of numbers, JSON text): bytes -> message,
  message -> numpy, numpy -> torch, tensor -> list, tensor -> numpy, numpy -> bytes, a device copy.
  A hop that only passes on what an inner hop made is no conversion.

The engine's computation is not the path: the first call into ``engines/training.py`` (or
``sampling.py``) is a hop, the engine entry, and what runs beneath it (model, losses, micro-batches)
is listed as ``engine_internal``, counted apart. With ``--engines process`` the engines run in a child
process and only this (the service's) process is followed: its table shows where the data is pickled
onto the pipe and read back, the child's side is not counted. ``ratio`` = hops / 30 (the target).

    python -m bench hops [--engines local|process] [--tokens 64]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import shutil
import sys
import tempfile
import threading
import types
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench import finish, parse_args

TARGET_HOPS = 30
_MIN_BYTES = 64  # shorter bytes that happen to occur in the body (an id, a name) are not its data
_ENGINE_FILES = ("engines/training.py", "engines/sampling.py")
_WRAPPERS = ("<lambda>", "<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")
_MAX_DEPTH = 3
_MAX_ITEMS = 64  # elements looked at per container


@dataclasses.dataclass
class Hop:
    """One function on the data path: where it ran and what representations went in and came out."""

    where: str
    thread: str
    order: int
    internal: bool  # beneath the engine entry: the engine's computation
    kinds_in: set[str] = dataclasses.field(default_factory=set)
    kinds_out: set[str] = dataclasses.field(default_factory=set)


class DataPath:
    """The profile hook: follows the op's data by object identity (each object is held, so no id is
    reused) and by memory (a numpy or torch view of data is data)."""

    def __init__(self, package: Path) -> None:
        self.root = str(package) + "/"
        self.skip = str(package / "client") + "/"
        self.on = False
        self.error: Exception | None = None
        self.body = b""
        self.hops: dict[str, Hop] = {}
        self._held: dict[int, Any] = {}
        self._kind_of: dict[int, str] = {}
        self._memory: list[tuple[int, int]] = []  # address ranges of the arrays and tensors held
        self._converted: dict[str, set[str]] = {}  # function -> representations it made data in, new to it
        self._maker: _Call | None = None  # the call new data is attributed to now
        self._frames: dict[int, _Call] = {}  # the calls of icefloe functions running now, by frame
        self._calls = 0
        self._lock = threading.Lock()

    def conversions(self, hop: Hop) -> set[str]:
        """The representations ``hop`` made data in that none of its data arguments had."""
        return self._converted.get(hop.where, set())

    # --- the data -------------------------------------------------------------------------------
    def seed(self, chunk: bytes) -> None:
        """A chunk of the body as it arrives; the icefloe function that reads it is the first hop."""
        with self._lock:
            self.body += chunk
            self._hold(chunk, "bytes", made=False)
            reader = sys._getframe(1)
            while reader is not None and not self._followed(reader.f_code.co_filename):
                reader = reader.f_back
            if reader is not None:
                self._calls += 1
                where = _where(reader.f_code, reader.f_code.co_filename, self.root)
                self._record(reader, where, self._calls).kinds_out.add("bytes")

    def _followed(self, path: str) -> bool:
        return path.startswith(self.root) and not path.startswith(self.skip)

    def _track(self, value: Any, depth: int = 0) -> bool:
        """Hold what ``value`` holds in a representation of numbers, and the containers holding it, as
        data; whether it holds any."""
        if id(value) in self._held:
            return True
        if depth > _MAX_DEPTH + 2 or value is None or isinstance(value, bool | int | float | complex | type):
            return False
        kind = _kind(value)
        if kind is not None:
            self._hold(value, kind)
            if kind == "protobuf":
                for inner in _inside(value):
                    self._track(inner, depth + 1)
            return True
        if not [inner for inner in _inside(value) if self._track(inner, depth + 1)]:
            return False
        self._hold(value, None)
        return True

    def _hold(self, value: Any, kind: str | None, *, made: bool = True) -> None:
        self._held[id(value)] = value
        if kind is None:
            return
        self._kind_of[id(value)] = kind
        maker = self._maker
        if made and maker is not None and kind not in maker.available:  # a representation it had not
            self._converted.setdefault(maker.where, set()).add(kind)
            maker.available.add(kind)
        if kind == "numpy" or kind.startswith("torch"):
            start = _address(value)
            self._memory.append((start, start + max(1, _nbytes(value))))

    def _is_data(self, value: Any, depth: int = 0) -> bool:
        if id(value) in self._held:
            return True
        kind = _kind(value)
        if kind == "bytes":  # the body's own bytes (a protobuf field read) are no new representation
            if len(value) >= _MIN_BYTES and bytes(value) in self.body:
                self._hold(value, kind, made=False)
                return True
            return False
        if kind == "numpy" or (kind or "").startswith("torch"):
            if any(start <= _address(value) < end for start, end in self._memory):  # a view of data
                self._hold(value, kind)
                return True
            return False
        if depth >= _MAX_DEPTH:
            return False
        return any(self._is_data(inner, depth + 1) for inner in _inside(value, closures=True))

    def _kinds(self, value: Any, depth: int = 0) -> set[str]:
        """The representations of the data inside ``value``."""
        kind = self._kind_of.get(id(value))
        if kind is not None:
            return {kind}
        found: set[str] = set()
        if depth < _MAX_DEPTH + 2:
            for inner in _inside(value, closures=True):
                found |= self._kinds(inner, depth + 1)
        return found

    # --- the hook -------------------------------------------------------------------------------
    def profile(self, frame: types.FrameType, event: str, arg: Any) -> None:
        if not self.on or (event != "call" and event != "return"):
            return
        code = frame.f_code
        path = code.co_filename
        if not self._followed(path):
            return
        with self._lock:
            try:
                if event == "call":
                    self._called(frame, code, path)
                else:
                    self._returned(frame, code, path, arg)
            except Exception as exc:  # the service must not see the hook fail: measure() raises it
                self.on, self.error = False, exc

    def _called(self, frame: types.FrameType, code: types.CodeType, path: str) -> None:
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount + _star_args(code)]
        given = [frame.f_locals.get(name) for name in names]
        if names and names[0] in ("self", "cls") and id(given[0]) not in self._held:
            given = given[1:]  # data reached through an object's attributes is not handed over
        self._maker = self._frames.get(id(frame.f_back))  # data first seen as an argument: made by the caller
        data = [value for value in given if self._is_data(value)]
        kinds = set().union(*(self._kinds(value) for value in data)) if data else set()
        self._calls += 1
        self._frames[id(frame)] = _Call(_where(code, path, self.root), kinds, bool(data), self._calls, set(kinds))

    def _returned(self, frame: types.FrameType, code: types.CodeType, path: str, value: Any) -> None:
        call = self._frames.pop(id(frame), None)
        if call is None:
            return
        self._maker = call
        returns_data = value is not None and self._is_data(value)
        if not call.received and not returns_data:
            return
        if call.received and value is not None:
            self._track(value)
        kinds_out = self._kinds(value) if value is not None else set()
        caller = self._frames.get(id(frame.f_back))
        if caller is not None:  # what an inner hop hands back is no new representation to its caller
            caller.available |= kinds_out
        hop = self._record(frame, call.where, call.order)
        hop.kinds_in |= call.kinds_in
        hop.kinds_out |= kinds_out

    def _record(self, frame: types.FrameType, where: str, order: int) -> Hop:
        internal = self._beneath_engine(frame, where)
        hop = self.hops.get(where)
        if hop is None:
            hop = Hop(where, threading.current_thread().name, order, internal)
            self.hops[where] = hop
        hop.order, hop.internal = min(hop.order, order), hop.internal and internal
        return hop

    def _beneath_engine(self, frame: types.FrameType, where: str) -> bool:
        """Whether an engine function (other than ``where`` itself) is on the stack below ``frame``."""
        caller = frame.f_back
        while caller is not None:
            path = caller.f_code.co_filename
            if path.removeprefix(self.root) in _ENGINE_FILES and _where(caller.f_code, path, self.root) != where:
                return True
            caller = caller.f_back
        return False


@dataclasses.dataclass
class _Call:
    """One running call of an icefloe function, between its call and return events."""

    where: str
    kinds_in: set[str]
    received: bool  # data among its arguments
    order: int
    available: set[str]  # representations it had: its arguments', and what its inner hops returned


def _star_args(code: types.CodeType) -> int:
    return bool(code.co_flags & 0x04) + bool(code.co_flags & 0x08)


def _where(code: types.CodeType, path: str, root: str) -> str:
    """``file:function``; a comprehension or lambda is its enclosing function."""
    name = code.co_qualname
    while name.rsplit(".", 1)[-1] in _WRAPPERS and "." in name:
        name = name.rsplit(".", 1)[0].removesuffix(".<locals>")
    return f"{path.removeprefix(root)}:{name}"


def _kind(value: Any) -> str | None:
    """The representation ``value`` holds numbers in, if it is one."""
    if isinstance(value, type):
        return None
    if isinstance(value, bytes | bytearray | memoryview):
        return "bytes"
    module = type(value).__module__
    if (module.startswith("google.") and "_message" in module) or module.endswith("_pb2"):
        return "protobuf"
    if module == "numpy" and hasattr(value, "dtype") and hasattr(value, "shape"):
        return "numpy"
    if module.startswith("torch") and type(value).__name__ in ("Tensor", "Parameter"):
        return f"torch/{value.device.type}"
    if isinstance(value, str):
        return "json" if len(value) > 8 and value[:1] in "{[" else None
    if isinstance(value, list) and value and isinstance(value[0], int | float) and not isinstance(value[0], bool):
        return "list"
    return None


def _address(value: Any) -> int:
    return value.__array_interface__["data"][0] if _kind(value) == "numpy" else value.data_ptr()


def _nbytes(value: Any) -> int:
    return value.nbytes if _kind(value) == "numpy" else value.untyped_storage().nbytes()


def _container(value: Any) -> bool:
    return isinstance(value, dict | list | tuple | set | functools.partial | types.GeneratorType) or (
        dataclasses.is_dataclass(value) and not isinstance(value, type)
    )


def _inside(value: Any, *, closures: bool = False) -> list[Any]:
    """What ``value`` holds: elements, fields, a partial's arguments, and (``closures``) a function's cells:
    data handed over in a closure is handed over."""
    if isinstance(value, dict):
        return list(value.values())[:_MAX_ITEMS]
    if isinstance(value, list | tuple | set):
        if _kind(value) == "list":  # numbers
            return []
        return [item for item in list(value)[:_MAX_ITEMS] if not isinstance(item, int | float | str | bool)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [getattr(value, f.name, None) for f in dataclasses.fields(value)]
    if isinstance(value, functools.partial):
        return [*value.args, *value.keywords.values()]
    if _kind(value) == "protobuf":
        return _proto_parts(value)
    if type(value).__module__.startswith("starlette.") and isinstance(getattr(value, "body", None), bytes):
        return [value.body]  # a response
    if closures and isinstance(value, types.FunctionType) and value.__closure__:
        cells = []
        for cell in value.__closure__:
            try:
                cells.append(cell.cell_contents)
            except ValueError:  # a cell not yet filled
                continue
        return cells
    return []


def _proto_parts(message: Any) -> list[Any]:
    """The sub-messages and repeated fields of a protobuf message (the wrappers are stable while held)."""
    if hasattr(message, "ListFields"):
        return [value for _, value in message.ListFields() if not isinstance(value, int | float | str | bytes)]
    if hasattr(message, "values") and callable(message.values):  # a map
        return list(message.values())[:_MAX_ITEMS]
    try:
        return list(message)[:_MAX_ITEMS]
    except TypeError:
        return []


class _SeedBody:
    """The app, with the body of each ``forward_backward`` POST handed to ``path.seed`` as it arrives."""

    def __init__(self, app: Any, path: DataPath) -> None:
        self.app, self.path = app, path

    def __getattr__(self, name: str) -> Any:
        return getattr(self.app, name)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].endswith("/forward_backward"):
            return await self.app(scope, receive, send)

        async def seeded() -> dict:
            message = await receive()
            if self.path.on and message.get("body"):
                self.path.seed(message["body"])
            return message

        return await self.app(scope, seeded, send)


def measure(engines: str, tokens: int) -> DataPath:
    """Run one warm-up and one measured forward_backward through the SDK; the measured one's data path."""
    import tinker
    from tinker import types as tinker_types

    import icefloe
    from icefloe.engines.models import resolve_model
    from icefloe.service.app import ServerThread, create_app
    from icefloe.service.settings import ServeSettings

    path = DataPath(Path(icefloe.__file__).resolve().parent)
    with tempfile.TemporaryDirectory() as tmp:
        models = Path(tmp) / "models"
        shutil.copytree(resolve_model("tiny:chat"), models / "tiny-chat")
        settings = ServeSettings(data_dir=Path(tmp) / "data", model_root=models, engines=engines, port=0)
        threading.setprofile(path.profile)
        sys.setprofile(path.profile)
        try:
            app = _SeedBody(create_app(settings), path)
            with ServerThread(app) as url:
                service = tinker.ServiceClient(base_url=url, api_key="tml-bench")
                training = service.create_lora_training_client(base_model="tiny-chat", rank=8).result()
                ids = [5 + i % 200 for i in range(tokens + 1)]
                datum = tinker_types.Datum(
                    model_input=tinker_types.ModelInput.from_ints(ids[:-1]),
                    loss_fn_inputs={"target_tokens": ids[1:], "weights": [0.5] * tokens},
                )
                training.forward_backward([datum], "cross_entropy").result()
                path.on = True
                training.forward_backward([datum], "cross_entropy").result()
                path.on = False
                service.close("success").result()
        finally:
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]
    if path.error is not None:
        raise RuntimeError("the profile hook failed") from path.error
    return path


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench hops", description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", choices=("local", "process"), default="local")
    parser.add_argument("--tokens", type=int, default=64, help="tokens of the one datum (>= 32)")
    args = parse_args(parser, argv, smoke={})
    path = measure(args.engines, max(args.tokens, 32))
    hops = sorted(path.hops.values(), key=lambda hop: hop.order)
    table = Table(title=f"the data path of one Tinker forward_backward (--engines {args.engines})")
    for column in ("#", "thread", "function", "data in", "data out", "conversion"):
        table.add_column(column)
    on_path = [hop for hop in hops if not hop.internal]
    for number, hop in enumerate(on_path, 1):
        made = " + ".join(sorted(path.conversions(hop)))
        thread = hop.thread.removeprefix("icefloe-")[:14]
        kinds_in, kinds_out = ", ".join(sorted(hop.kinds_in)), ", ".join(sorted(hop.kinds_out))
        table.add_row(str(number), thread, hop.where, kinds_in, kinds_out, f"-> {made}" if made else "")
    Console(width=200).print(table)
    internal = [hop for hop in hops if hop.internal]
    names = ", ".join(hop.where.rsplit(":", 1)[-1] for hop in internal)
    print(f"engine_internal: {len(internal)} functions beneath the engine entry, not counted: {names}")
    conversions = sum(len(path.conversions(hop)) for hop in on_path)
    summary = f"bench=hops ratio={len(on_path) / TARGET_HOPS:.2f} hops={len(on_path)} conversions={conversions}"
    finish(args, f"{summary} engine_internal={len(internal)} engines={args.engines}")
