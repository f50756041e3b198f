"""`shoal.load` (a flow from a file, a package directory, or `module:name`) and `shoal.run`.

Whatever goes wrong is a `FlowError` naming the file and line: a file that does not import,
a reference that names nothing, a function that is not `async def`.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import traceback
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

from shoal.errors import FlowError
from shoal.flows import Flow
from shoal.runtime import runtime


def load(ref: str | Path) -> Flow:
    """`path/to/flows.py[:name]`, `path/to/package[:name]` or `package.module[:name]`."""
    if not isinstance(ref, (str, Path)) or not str(ref).strip():
        raise FlowError(f"a flow reference is 'path/to/flows.py[:name]', 'path/to/package[:name]' or "
                        f"'package.module[:name]'; got {ref!r}")
    text = str(ref)
    target, _, name = text.partition(":") if not Path(text).exists() else (text, "", "")
    path = Path(target)
    module = _import_path(path) if path.suffix == ".py" or path.exists() else _import_module(target)
    return _pick(module, name or None, str(getattr(module, "__file__", target)))


def _import_path(path: Path) -> ModuleType:
    if path.is_dir():
        init = path / "__init__.py"
        if not init.exists():
            raise FlowError(f"{path} is a directory without __init__.py; point at a .py file or a package")
        file, search = init, [str(path)]
    elif path.is_file():
        file, search = path, None
    else:
        raise FlowError(f"{path}: no such flow file")
    name = f"shoal_flow_{path.stem}_{uuid.uuid4().hex[:6]}"
    spec = importlib.util.spec_from_file_location(name, file, submodule_search_locations=search)
    if spec is None or spec.loader is None:
        raise FlowError(f"{file}: cannot be imported as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise FlowError(f"{_where(exc, file)}: the flow file failed to import: {type(exc).__name__}: {exc}") from exc
    return module


def _import_module(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        raise FlowError(f"{name!r} is neither a flow file nor an importable module ({exc})") from exc
    except Exception as exc:
        raise FlowError(f"{_where(exc, None)}: module {name!r} failed to import: {type(exc).__name__}: {exc}") from exc


def _where(exc: BaseException, file: Path | None) -> str:
    """file:line of the failure, in the flow's own file where the traceback passes through it."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{exc.filename}:{exc.lineno}"
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if file is not None and Path(f.filename) == Path(file)]
    found = mine or frames
    return f"{found[-1].filename}:{found[-1].lineno}" if found else str(file)


def _pick(module: ModuleType, name: str | None, where: str) -> Flow:
    if name:
        if not hasattr(module, name):
            raise FlowError(f"{where}: names no {name!r}; flows there: {_names(module) or 'none'}")
        return _as_flow(getattr(module, name), where)
    flows = [v for v in vars(module).values() if isinstance(v, Flow)]
    if len(flows) == 1:
        return flows[0]
    if "main" in vars(module):
        return _as_flow(module.main, where)
    if not flows:
        raise FlowError(f"{where}: defines no flow (mark an `async def` with @shoal.flow, or name one: FILE:NAME)")
    raise FlowError(f"{where}: defines several flows ({_names(module)}); name one: {where}:NAME")


def _as_flow(obj: Any, where: str) -> Flow:
    if isinstance(obj, Flow):
        return obj
    if inspect.iscoroutinefunction(obj):
        return Flow(obj)
    if callable(obj):
        return Flow(obj)  # raises FlowError naming file:line: not async
    raise FlowError(f"{where}: {obj!r} is not a flow")


def _names(module: ModuleType) -> str:
    return ", ".join(k for k, v in vars(module).items() if isinstance(v, Flow))


def run(target: Flow | str | Path, *args: Any, **kwargs: Any) -> Any:
    """The blocking entry: run a flow (or a reference `load` understands) to its end."""
    if isinstance(target, Flow):
        f = target
    elif isinstance(target, (str, Path)):
        f = load(target)
    elif callable(target):
        f = _as_flow(target, repr(target))  # an `async def` not marked @shoal.flow runs as one; else FlowError
    else:
        raise FlowError(f"shoal.run takes a flow (an `async def` marked @shoal.flow) or a reference to one "
                        f"('file.py[:name]', 'module:name'); got {target!r}")
    return runtime.call(f(*args, **kwargs))
