"""The data path of one Tinker ``forward_backward``: how many icefloe functions carry its data, and how
often its numbers change representation on the way.

The tinker SDK submits one ``forward_backward`` and polls it with ``retrieve_future`` (``.result()``)
against a real service in this process (``create_app`` on uvicorn in a thread), after one unmeasured
call that warms every lazy import. A profile hook on every thread follows the op's data:

* the DATA is the request body (as uvicorn hands it to the app: any bytes that are part of it, and
  every protobuf message parsed from it), and any object an earlier hop made from it: what a hop
  returns (walked into containers, dataclasses and protobuf messages), a numpy or torch view of it,
  and the arrays and tensors an engine process's pipe brings back to the call that sent it;
* a HOP is a call of an icefloe function that receives the data as an argument (inside a container,
  a dataclass, a ``functools.partial`` or a closure it is handed) or returns it, that reads the
  body or receives a pipe's message holding it, or that makes it in a new representation (a
  conversion, say a parse it calls in place); distinct functions are counted, comprehensions and
  lambdas belonging to the function that encloses them. A message parsed from the data is data
  however deep its numbers lie;
* a CONVERSION is a representation (bytes, protobuf, numpy, torch on a device, a list of numbers,
  JSON text) a hop makes data in that it did not have (from its arguments, or from what its inner
  hops returned): bytes -> message, message -> numpy, numpy -> torch, tensor -> list, tensor ->
  numpy, numpy -> bytes, a device copy. Each counts once per hop; one that only passes on what an
  inner hop made converts nothing.

The engine's computation is not the path: the first call into ``engines/training.py`` (or
``sampling.py``) is a hop, the engine entry, and what runs beneath it (model, losses, micro-batches)
is listed as ``engine_internal``, counted apart. ``--engines process`` runs the engines in a child
process (the default of ``icefloe serve``) and follows it too: the forkserver it forks from imports
this module, which follows the data there from the message whose arrays or tensors hold the measured
op's tokens (the warm-up op's differ), from where the pipe's ``exchange`` returns it. Arrays and
tensors a pipe brings (there, and back in the service to a call that sent data) are data in the
representation they arrived in, as the body's bytes are: the transport, not a conversion; the
function that received them is a hop, as ``read_body`` is for the body (the loop that called it,
like a route that called ``read_body``, is one only if it is handed data or converts it).
``ratio`` = hops / 30 (the issue's target).

    python -m bench hops [--engines local|process] [--tokens 64]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from bench import finish, parse_args

TARGET_HOPS = 30
_MIN_BYTES = 64  # shorter bytes that happen to occur in the body (an id, a name) are not its data
_ENGINE_FILES = ("engines/training.py", "engines/sampling.py")
_COMPREHENSIONS = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")
_WRAPPERS = ("<lambda>", *_COMPREHENSIONS)
_MAX_DEPTH = 5
_MAX_ITEMS = 64  # elements looked at per container
_WIRE_FILE = "service/hosts/process.py"
_ARRIVAL = "Pipe.exchange"  # where a message from the other end of an engine process's pipe is returned
_CHILD_ENV = "ICEFLOE_BENCH_HOPS"  # "<bench pid>:<folder>:<marker hex>": follow an engine process too


@dataclasses.dataclass
class Hop:
    """One function on the data path: where it ran and what representations went in and came out."""

    where: str
    thread: str
    order: int  # time.monotonic_ns() of its first call: one clock for every process of the machine
    internal: bool  # beneath the engine entry: the engine's computation
    kinds_in: set[str] = dataclasses.field(default_factory=set)
    kinds_out: set[str] = dataclasses.field(default_factory=set)
    made: set[str] = dataclasses.field(default_factory=set)  # its conversions: representations new to it
    process: str = "service"


class DataPath:
    """The profile hook: follows the op's data by object identity (each object is held, so no id is
    reused) and by memory (a numpy or torch view of data is data)."""

    def __init__(self, package: Path, *, marker: bytes | None = None, out: Path | None = None) -> None:
        self.root = str(package) + "/"
        self.skip = str(package / "client") + "/"
        self.on = False
        self.error: Exception | None = None
        self.marker, self.out = marker, out  # an engine process: the data arrives holding these bytes
        self.sources: list[bytes] = []  # the bytes the op's data arrived in: the body, what a pipe brought
        self.hops: dict[str, Hop] = {}
        self._held: dict[int, Any] = {}
        self._kind_of: dict[int, str] = {}
        self._memory: list[tuple[int, int]] = []  # address ranges of the arrays and tensors held
        self._made: dict[str, set[str]] = {}  # function -> representations it made data in, new to it
        self._maker: _Call | None = None  # the call new data is attributed to now
        self._frames: dict[int, _Call] = {}  # the calls of icefloe functions running now, by frame
        self._lock = threading.Lock()

    # --- the data -------------------------------------------------------------------------------
    def seed(self, chunk: bytes, frame: types.FrameType | None) -> None:
        """Bytes of the op's data as they arrive (the body); the icefloe function on the stack from
        ``frame`` down that reads them is a hop."""
        with self._lock:
            self.sources.append(bytes(chunk))
            self._hold(chunk, "bytes", made=False)
            self._read_by(frame, {"bytes"})
            self._save()

    def _read_by(self, frame: types.FrameType | None, kinds: set[str]) -> None:
        """The icefloe function on the stack from ``frame`` down is a hop that reads data in ``kinds``."""
        reader = frame
        while reader is not None and not self._followed(reader.f_code.co_filename):
            reader = reader.f_back
        if reader is None:
            return
        call = self._frames.get(id(reader))
        if call is None:  # called before the data came: it holds the data from here on
            where = _where(reader.f_code, reader.f_code.co_filename, self.root)
            call = self._frames[id(reader)] = _Call(where, set(), True, time.monotonic_ns(), set(kinds), reader)
        call.available |= kinds
        self._record(reader, call.where, call.order).kinds_out |= kinds

    def _arrived(self, frame: types.FrameType, message: Any) -> None:
        """What a pipe brought (the return of ``Pipe.exchange``): in an engine process, the op's call once
        an array or tensor in it holds the marker; in the service, the reply to a call that sent the op's
        data. Its arrays and tensors are data as they arrived."""
        arrays = _arrays(message)
        if self.marker is not None and not self.on:
            if any(self.marker in _raw(array) for array in arrays):
                with self._lock:
                    self.on = True
                    kinds = self._arrive(arrays)
                    self._read_by(frame, kinds)  # the receiving function, as read_body is of the body
                    self._save()
            return
        call = self._frames.get(id(frame))
        if self.on and call is not None and call.received:
            with self._lock:
                self._arrive(arrays)

    def _arrive(self, arrays: list[Any]) -> set[str]:
        """Hold ``arrays`` as data in the representation they arrived in; their kinds."""
        kinds = set()
        for array in arrays:
            kind = _kind(array)
            self._hold(array, kind, made=False)
            kinds.add(kind)
        return kinds

    def _in_sources(self, raw: bytes) -> bool:
        return len(raw) >= _MIN_BYTES and any(raw in source for source in self.sources)

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
            self._made.setdefault(maker.where, set()).add(kind)
            maker.available.add(kind)
            if maker.frame is not None:  # what converts data is on its path, whatever it was handed
                self._record(maker.frame, maker.where, maker.order)
        if kind == "numpy" or kind.startswith("torch"):
            start = _address(value)
            self._memory.append((start, start + max(1, _nbytes(value))))

    def _is_data(self, value: Any, depth: int = 0) -> bool:
        if id(value) in self._held:
            return True
        kind = _kind(value)
        if kind == "bytes":  # bytes the data came in (a protobuf field read) are no new representation
            if self._in_sources(bytes(value)):
                self._hold(value, kind, made=False)
                return True
            return False
        # A message parsed from the data, however deep its numbers lie: its bytes are the data's (a parse
        # called in place, by no icefloe function that returns it, is seen here).
        if kind == "protobuf" and hasattr(value, "SerializeToString") and self._in_sources(value.SerializeToString()):
            self._hold(value, kind)
            return True
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
        code = frame.f_code
        if event == "return" and code.co_qualname == _ARRIVAL and code.co_filename.endswith(_WIRE_FILE):
            self._arrived(frame, arg)
        if not self.on or (event != "call" and event != "return"):
            return
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
        if code.co_name in _COMPREHENSIONS:  # part of the call that runs it: what it makes, that call made
            enclosing = self._frames.get(id(frame.f_back))
            if enclosing is not None:
                self._frames[id(frame)] = enclosing
                self._maker = enclosing
                return
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount + _star_args(code)]
        given = [frame.f_locals.get(name) for name in names]
        if names and names[0] in ("self", "cls") and id(given[0]) not in self._held:
            given = given[1:]  # data reached through an object's attributes is not handed over
        self._maker = self._frames.get(id(frame.f_back))  # data first seen as an argument: made by the caller
        data = [value for value in given if self._is_data(value)]
        kinds = set().union(*(self._kinds(value) for value in data)) if data else set()
        where = _where(code, path, self.root)
        self._frames[id(frame)] = _Call(where, kinds, bool(data), time.monotonic_ns(), set(kinds), frame)

    def _returned(self, frame: types.FrameType, code: types.CodeType, path: str, value: Any) -> None:
        call = self._frames.pop(id(frame), None)
        if call is None or (code.co_name in _COMPREHENSIONS and call is self._frames.get(id(frame.f_back))):
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
        self._save()

    def followed(self) -> list[Hop]:
        """The hops so far, each with its conversions."""
        for hop in self.hops.values():
            hop.made = set(self._made.get(hop.where, ()))
        return list(self.hops.values())

    def _save(self) -> None:
        """An engine process writes what it followed so far (it never exits by itself): the service reads it."""
        if self.out is None:
            return
        hops = [dataclasses.asdict(hop) for hop in self.followed()]
        for hop in hops:
            hop |= {name: sorted(hop[name]) for name in ("kinds_in", "kinds_out", "made")}
            hop["process"] = "engines"
        (self.out / f"{os.getpid()}.json").write_text(json.dumps(hops))

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
    order: int  # time.monotonic_ns() when it was called
    available: set[str]  # representations it had: its arguments', and what its inner hops returned
    frame: types.FrameType | None = None


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


def _arrays(value: Any, depth: int = 0) -> list[Any]:
    """The numpy arrays and torch tensors inside ``value``."""
    if (_kind(value) or "").startswith(("numpy", "torch")):
        return [value]
    if depth > _MAX_DEPTH + 2:
        return []
    return [array for inner in _inside(value) for array in _arrays(inner, depth + 1)]


def _raw(array: Any) -> bytes:
    """The bytes of an array's or tensor's numbers."""
    if _kind(array) == "numpy":
        return array.tobytes()
    import torch

    return array.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


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

        body = bytearray()

        async def seeded() -> dict:
            message = await receive()
            body.extend(message.get("body", b""))
            if self.path.on and body and not message.get("more_body"):
                self.path.seed(bytes(body), sys._getframe())
                # This wrapper is every layer's ``receive``: holding the body here would make each layer
                # that awaits (a suspension reads as a return) look as if it were handed the data.
                body.clear()
            return message

        return await self.app(scope, seeded, send)


def measure(engines: str, tokens: int) -> list[Hop]:
    """Run one warm-up and one measured forward_backward through the SDK; the measured one's hops, in
    the service and (``engines="process"``) in its engine process."""
    import tinker
    from tinker import types as tinker_types

    import icefloe
    from icefloe.engines.models import resolve_model
    from icefloe.service.app import ServerThread, create_app
    from icefloe.service.settings import ServeSettings

    path = DataPath(Path(icefloe.__file__).resolve().parent)
    ids = [5 + i * 37 % 90 for i in range(tokens + 1)]  # below tiny:chat's 98 ids; no run of position ids
    with tempfile.TemporaryDirectory() as tmp:
        models, followed = Path(tmp) / "models", Path(tmp) / "engine-processes"
        followed.mkdir()
        shutil.copytree(resolve_model("tiny:chat"), models / "tiny-chat")
        settings = ServeSettings(data_dir=Path(tmp) / "data", model_root=models, engines=engines, port=0)
        marker = np.asarray(ids[:16], dtype=np.int64).tobytes()  # how the measured op's tokens cross a pipe
        os.environ[_CHILD_ENV] = f"{os.getpid()}:{followed}:{marker.hex()}"
        _preload_in_forkserver()
        threading.setprofile(path.profile)
        sys.setprofile(path.profile)
        try:
            app = _SeedBody(create_app(settings), path)
            with ServerThread(app) as url:
                service = tinker.ServiceClient(base_url=url, api_key="tml-bench")
                training = service.create_lora_training_client(base_model="tiny-chat", rank=8).result()

                def datum(shift: int) -> Any:
                    shifted = [i + shift for i in ids]
                    inputs = {"target_tokens": shifted[1:], "weights": [0.5] * tokens}
                    return tinker_types.Datum(model_input=tinker_types.ModelInput.from_ints(shifted[:-1]),
                                              loss_fn_inputs=inputs)  # fmt: skip

                training.forward_backward([datum(1)], "cross_entropy").result()  # warms up; its tokens differ
                path.on = True
                training.forward_backward([datum(0)], "cross_entropy").result()
                path.on = False
                service.close("success").result()
                hops = path.followed()
                for saved in followed.glob("*.json"):
                    hops += [Hop(**{**hop, **{k: set(hop[k]) for k in ("kinds_in", "kinds_out", "made")}})
                             for hop in json.loads(saved.read_text())]  # fmt: skip
        finally:
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]
            os.environ.pop(_CHILD_ENV, None)
    if path.error is not None:
        raise RuntimeError("the profile hook failed") from path.error
    return sorted(hops, key=lambda hop: hop.order)


def _preload_in_forkserver() -> None:
    """Have the forkserver that engine processes fork from import this module, which then follows the
    data in each of them (:func:`_follow_engine_process`)."""
    from multiprocessing import forkserver

    preload = forkserver.set_forkserver_preload

    def with_this_module(modules: list[str]) -> None:
        preload([*modules, __name__])

    forkserver.set_forkserver_preload = with_this_module


def _follow_engine_process() -> None:
    """In a process forked from the forkserver (``_CHILD_ENV`` set by another process), follow the op's
    data from the pipe message that holds its tokens on."""
    spec = os.environ.get(_CHILD_ENV)
    if not spec or int(spec.split(":", 1)[0]) == os.getpid():
        return
    import icefloe

    _, folder, marker = spec.split(":", 2)
    path = DataPath(Path(icefloe.__file__).resolve().parent, marker=bytes.fromhex(marker), out=Path(folder))
    threading.setprofile(path.profile)
    sys.setprofile(path.profile)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench hops", description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", choices=("local", "process"), default="local")
    parser.add_argument("--tokens", type=int, default=64, help="tokens of the one datum (>= 32)")
    args = parse_args(parser, argv, smoke={})
    hops = measure(args.engines, max(args.tokens, 32))
    table = Table(title=f"the data path of one Tinker forward_backward (--engines {args.engines})")
    for column in ("#", "process", "thread", "function", "data in", "data out", "conversion"):
        table.add_column(column)
    on_path = [hop for hop in hops if not hop.internal]
    for number, hop in enumerate(on_path, 1):
        made = " + ".join(sorted(hop.made))
        thread = hop.thread.removeprefix("icefloe-")[:14]
        kinds_in, kinds_out = ", ".join(sorted(hop.kinds_in)), ", ".join(sorted(hop.kinds_out))
        table.add_row(str(number), hop.process, thread, hop.where, kinds_in, kinds_out, f"-> {made}" if made else "")
    Console(width=200).print(table)
    internal = [hop for hop in hops if hop.internal]
    names = ", ".join(hop.where.rsplit(":", 1)[-1] for hop in internal)
    print(f"engine_internal: {len(internal)} functions beneath the engine entry, not counted: {names}")
    if not on_path:
        raise SystemExit("no hop was followed: the bench no longer finds the op's data")
    conversions = sum(len(hop.made) for hop in on_path)
    processes = sorted({hop.process for hop in on_path})
    per_process = " ".join(f"{name}_hops={sum(h.process == name for h in on_path)}" for name in processes)
    summary = f"bench=hops ratio={len(on_path) / TARGET_HOPS:.2f} hops={len(on_path)} conversions={conversions}"
    record_as = "hops" if args.engines == "local" else f"hops-{args.engines}"
    finish(args, f"{summary} {per_process} engine_internal={len(internal)} engines={args.engines}", record_as)


_follow_engine_process()
