"""Lower layers never import higher ones (the order in the house sketch)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "shoal"

# module prefix -> layer; a module may import only from its own layer or below
LAYERS = {
    "errors": 0, "reply": 0, "prices": 0, "loopback": 0,
    "procs": 1, "runtime": 1, "scope": 1, "journal": 1, "homes": 1,
    "backends": 2, "places": 2, "hosts": 2,
    "session": 3, "flows": 3,
    "fleet": 4,
    "agent": 5,
    "loader": 6, "perfetto": 6, "demo": 6, "concurrency": 6,
    "cli": 7, "watch": 7,
}


def layer_of(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "shoal" or len(parts) < 2:
        return None
    return LAYERS.get(parts[1])


def imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
        elif isinstance(node, ast.Import):
            out.extend(a.name for a in node.names)
    return out


def test_every_module_has_a_layer() -> None:
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).with_suffix("")
        if rel.parts[0] in ("__init__", "__main__"):
            continue
        assert layer_of("shoal." + ".".join(rel.parts)) is not None, f"{rel} has no layer in LAYERS"


def test_no_module_imports_a_higher_layer() -> None:
    bad = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).with_suffix("")
        if rel.parts[0] == "__init__":
            continue  # the public API re-exports everything
        own = layer_of("shoal." + ".".join(rel.parts))
        assert own is not None
        for mod in imports(path):
            other = layer_of(mod)
            if other is not None and other > own:
                bad.append(f"{rel} (layer {own}) imports {mod} (layer {other})")
    assert bad == []


def test_backends_and_places_do_not_know_each_other() -> None:
    for kind, other in (("backends", "shoal.places"), ("places", "shoal.backends")):
        for path in (SRC / kind).rglob("*.py"):
            assert not any(m.startswith(other) for m in imports(path)), f"{path.name} imports {other}"
