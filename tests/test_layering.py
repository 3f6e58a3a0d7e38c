"""Layering: the pure layers import no Megatron, Ray, SGLang or transformers."""

import subprocess
import sys

import pytest

HEAVY = ("megatron", "ray", "sglang", "transformers", "sao_megatron.megatron_cpu")


@pytest.mark.parametrize("module", ["sao_megatron.algo", "sao_megatron.config", "sao_megatron.envs"])
def test_pure_modules_import_nothing_heavy(module):
    code = (
        f"import sys, importlib; importlib.import_module({module!r}); "
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {('megatron', 'ray', 'sglang', 'transformers')!r} "
        f"or m == 'sao_megatron.megatron_cpu'); print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"{module} pulled in {out.stdout.strip()}"


def test_algo_sources_do_not_mention_heavy_packages():
    from pathlib import Path

    import sao_megatron.algo as algo

    for path in Path(algo.__file__).parent.rglob("*.py"):
        text = path.read_text()
        for name in ("megatron", "ray", "sglang", "transformers"):
            assert f"import {name}" not in text and f"from {name}" not in text, f"{path} imports {name}"
    assert HEAVY


# Layers, lowest first. A module may import (at module level or inside a function) only from
# its own layer or a lower one; within a layer, packages must not import each other in a cycle.
LAYERS: list[set[str]] = [
    {"algo", "records", "routing", "megatron_cpu", "logs", "faults", "provenance", "runtime"},
    {"config", "tokenizer"},
    {"parallel", "spawn", "batch", "context_parallel", "envs"},
    {"models", "rollout", "buffer"},
    {"weight_sync", "workers"},
    {"observe", "plan", "submit"},
    {"driver"},
    {"pipeline", "report", "sweep"},
    {"cli", "cli_checkpoints", "cli_swe"},
]
DRIVER_ONLY = {"ray"}  # the driver is the only place that knows about Ray


def _imports():
    """(importing unit, imported unit, file, line) for every sao_megatron import in the package."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "sao_megatron"
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        unit = rel.parts[0] if len(rel.parts) > 1 else rel.name
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                base = node.module.split(".")
                if base[0] == "sao_megatron":
                    names = [f"{node.module}.{a.name}" if len(base) == 1 else node.module for a in node.names]
                elif base[0] in DRIVER_ONLY:
                    names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.split(".")[0] in ("sao_megatron", *DRIVER_ONLY)]
            for name in names:
                parts = name.split(".")
                target = parts[1] if parts[0] == "sao_megatron" and len(parts) > 1 else parts[0]
                yield unit, target, path.relative_to(root.parent), node.lineno


def _layer(unit: str) -> int:
    for i, layer in enumerate(LAYERS):
        if unit in layer:
            return i
    raise AssertionError(f"sao_megatron/{unit} is in no layer of tests/test_layering.py: place it")


def test_imports_point_down_the_layers():
    bad = []
    for unit, target, path, line in _imports():
        if target in DRIVER_ONLY:
            if unit not in ("driver", "pipeline", "cli", "submit"):
                bad.append(f"{path}:{line} {unit} imports {target}")
        elif target != unit and _layer(target) > _layer(unit):
            bad.append(f"{path}:{line} {unit} (layer {_layer(unit)}) imports {target} (layer {_layer(target)})")
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_no_import_cycles_between_units():
    import collections

    graph = collections.defaultdict(set)
    for unit, target, _, _ in _imports():
        if target != unit and target not in DRIVER_ONLY:
            graph[unit].add(target)

    def reaches(start, goal, seen):
        return any(n == goal or (n not in seen and not seen.add(n) and reaches(n, goal, seen)) for n in graph[start])

    cycles = sorted(u for u in list(graph) if reaches(u, u, set()))
    assert not cycles, f"import cycles through {cycles}"


def module_import_graph(root) -> dict[str, set[str]]:
    """``{module: modules it imports}`` over the package at ``root``, every import counted (module
    level or inside a function). ``from P import x`` names module ``P.x`` when that is a module
    file, else ``P`` itself (its ``__init__``, which runs first either way)."""
    import ast

    modules = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        modules[".".join(parts)] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolved against this module's package
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            for target in targets:
                while target and target not in modules:  # import a.b.c runs a, a.b, a.b.c
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles_between_modules():
    """No two modules import each other, directly or through others, even inside a function: such a
    circle works only by the order of imports, and a lazy import hides it (config/hf.py <-> load.py)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "sao_megatron"
    cycles = import_cycles(module_import_graph(root))
    assert not cycles, "import circles between modules:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_check_catches_a_lazy_import_circle(tmp_path):
    """The check on a package like the old config/hf.py <-> config/load.py: one side imports the
    other inside a function, and through the package's ``__init__``."""
    pkg = tmp_path / "pkg"
    (pkg / "config").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "config" / "__init__.py").write_text("from pkg.config.load import build\n")
    (pkg / "config" / "load.py").write_text("def model():\n    from pkg.config import hf\n    return hf\n")
    (pkg / "config" / "hf.py").write_text("from pkg.config import build\n")
    (pkg / "config" / "ok.py").write_text("import pkg.config.hf\n")
    assert import_cycles(module_import_graph(pkg)) == [["pkg.config", "pkg.config.hf", "pkg.config.load"]]
