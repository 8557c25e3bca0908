"""The tree keeps the shape docs/architecture.md draws: layers, optional-dependency boundaries and
a module table that names every module."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvconnect"

# A layer may import only the layers after it in this order (kvconnect.* top-level modules such
# as errors, auth and etcd are shared by all). bench and testing drive the library from outside.
LAYERS = (
    "kvconnect.transfer",
    ("kvconnect.store", "kvconnect.p2p"),
    ("kvconnect.sglang", "kvconnect.vllm"),
    "kvconnect.router",
)
# Layers that speak to the layers below over the wire and may not import them.
WIRE_ONLY = {"kvconnect.router": ("kvconnect.sglang", "kvconnect.vllm")}
OUTSIDE = ("kvconnect.bench", "kvconnect.testing", "kvconnect.cli")

# Optional or heavy dependencies, and the only modules allowed to import them.
BOUNDARIES = {
    "pyverbs": ("kvconnect.transfer.transports.rdma.verbs",),
    "pyetcd": ("kvconnect.etcd",),
    "sglang": ("kvconnect.sglang", "kvconnect.bench.sglang"),  # the bench drives SGLang's code
    "vllm": ("kvconnect.vllm",),
    "safetensors": ("kvconnect.vllm.loader", "kvconnect.bench.tiny_llama"),
    "torch": ("kvconnect.sglang", "kvconnect.vllm", "kvconnect.bench"),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}


def _imports(path: Path) -> set[str]:
    """Every absolute module an import statement in ``path`` names (lazy imports included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _layer(name: str) -> int | None:
    for index, layer in enumerate(LAYERS):
        if _within(name, layer if isinstance(layer, tuple) else (layer,)):
            return index
    return None


@pytest.mark.parametrize("module", sorted(_modules()))
def test_imports_flow_down_the_layers(module: str) -> None:
    own = _layer(module)
    for imported in _imports(_modules()[module]):
        if _within(imported, OUTSIDE):
            assert _within(module, OUTSIDE), f"{module} imports {imported} (bench/testing/cli)"
        target = _layer(imported)
        if own is None or target is None:
            continue
        same_package = imported.split(".")[:2] == module.split(".")[:2]
        assert target < own or same_package, f"{module} imports {imported}: against the layers"


@pytest.mark.parametrize("layer", sorted(WIRE_ONLY))
def test_a_wire_only_layer_imports_none_of_what_it_speaks_to(layer: str) -> None:
    offenders = [
        f"{module} imports {name}"
        for module, path in _modules().items()
        if _within(module, (layer,))
        for name in _imports(path)
        if _within(name, WIRE_ONLY[layer])
    ]
    assert offenders == []


@pytest.mark.parametrize("dependency", sorted(BOUNDARIES))
def test_optional_dependencies_stay_inside_their_boundary(dependency: str) -> None:
    offenders = [
        module
        for module, path in _modules().items()
        if any(_within(name, (dependency,)) for name in _imports(path))
        and not _within(module, BOUNDARIES[dependency])
    ]
    assert offenders == [], f"{dependency} imported outside {BOUNDARIES[dependency]}"


def test_module_table_names_every_module() -> None:
    """Each package and module has one row in a module table of docs/architecture.md."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    listed = set(re.findall(r"^\| `(kvconnect/[\w/.]*)` \|", text, flags=re.M))
    actual = {
        str(path.relative_to(ROOT).parent) + "/"
        if path.name == "__init__.py"
        else str(path.relative_to(ROOT))
        for path in _modules().values()
    }
    assert sorted(actual - listed) == [], "modules missing from docs/architecture.md"
    assert sorted(listed - actual) == [], "docs/architecture.md lists modules that do not exist"


@pytest.mark.parametrize(
    "script", sorted(p.name for p in (PACKAGE / "bench" / "baselines").glob("*_runner.py"))
)
def test_a_runner_script_imports_no_neighbour_in_place_of_a_package(script: str) -> None:
    # A runner runs as a script in another interpreter: its folder leads sys.path there, so a
    # neighbour named like a package it imports (mooncake.py) would be imported instead.
    folder = PACKAGE / "bench" / "baselines"
    tree = ast.parse((folder / script).read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        node.module.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and not node.level
    }
    neighbours = {p.stem for p in folder.glob("*.py")}
    assert not imported & neighbours
