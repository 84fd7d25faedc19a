"""Who imports whom inside `paged_kv_compile`: no circles, and the layers the README describes.

Read statically from every module's source (module-level and function-level imports alike, except
`if TYPE_CHECKING:` blocks), so a circle hidden behind a lazy import is found too. Importing a
submodule also runs its parent packages' `__init__`; those implicit edges are not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "paged_kv_compile"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package modules `path` imports (resolved: `from . import x` names module x when it is one)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == PACKAGE)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == PACKAGE:
                subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
                found.update(subs if subs and len(subs) == len(node.names) else [target, *subs])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    found.discard(name)
    return {m for m in found if m in modules}


def import_graph() -> dict[str, set[str]]:
    paths = sorted(ROOT.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    return {_module_name(p): _imports(p, modules) for p in paths}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = dfs(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = dfs(node)
            if cycle:
                return cycle
    return None


def test_the_package_has_no_import_circle():
    cycle = _find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_one():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def _layer(prefix: str) -> dict[str, set[str]]:
    return {m: deps for m, deps in import_graph().items() if m == prefix or m.startswith(prefix + ".")}


#: The generic layers: they reach a family only through the registry (`families`) and its base class.
GENERIC = ("paged_kv_compile.runtime", "paged_kv_compile.scheduler", "paged_kv_compile.capture",
           "paged_kv_compile.driver", "paged_kv_compile.cli", "paged_kv_compile.demo")
FAMILY_MODULES = ("paged_kv_compile.families.", "paged_kv_compile.models.", "paged_kv_compile.adapters")
#: what a generic layer may import from those: the registry's base class and the loops' hooks seam (no model)
GENERIC_SEAMS = ("paged_kv_compile.families.base", "paged_kv_compile.families.demo", "paged_kv_compile.models.hooks")
GENERIC_FILES = ["runtime.py", "scheduler.py", "driver.py", "cli.py", "demo.py", *(f"capture/{p.name}" for p in
                                                            sorted((ROOT / "capture").glob("*.py")))]
FAMILY_WORDS = ("dreamzero", "hunyuan")
#: the benchmarks' shared module is generic too: the families' configs and setups live in benchmarks/_models.py
BENCHMARKS_COMMON = ROOT.parent / "benchmarks" / "_common.py"


@pytest.mark.parametrize("layer", GENERIC)
def test_generic_layers_import_no_family_module(layer):
    """`families` (the registry) and `families.base` only: never a family's module or its model."""
    bad = {m: sorted(d for d in deps if d.startswith(FAMILY_MODULES) and d not in GENERIC_SEAMS)
           for m, deps in _layer(layer).items()}
    bad = {m: d for m, d in bad.items() if d}
    assert not bad, f"{layer} imports family modules: {bad}"


def _family_imports(path: Path) -> list[str]:
    """The family modules (and models) a file imports, beyond the registry, its base class and the hooks seam."""
    modules = set(import_graph())
    return sorted(d for d in _imports(path, modules) if d.startswith(FAMILY_MODULES) and d not in GENERIC_SEAMS)


def test_the_benchmarks_common_module_imports_no_family_module():
    bad = _family_imports(BENCHMARKS_COMMON)
    assert not bad, f"benchmarks/_common.py imports family modules {bad}; move that code to benchmarks/_models.py"


@pytest.mark.parametrize("name", GENERIC_FILES + ["../benchmarks/_common.py"])
def test_generic_files_name_no_family(name):
    """Not even in a docstring or a message: what is specific to a family is taught from its module."""
    text = (ROOT / name).read_text().lower()
    found = [w for w in FAMILY_WORDS if w in text]
    assert not found, f"{name} names a family ({found}); move that knowledge to families/<family>.py"


def test_the_family_word_check_finds_a_family_name():
    """The checks above are not vacuous: they read the files they name and would see a family there."""
    assert all((ROOT / name).is_file() for name in GENERIC_FILES) and BENCHMARKS_COMMON.is_file()
    assert any(w in (ROOT / "families" / "dreamzero.py").read_text().lower() for w in FAMILY_WORDS)
    assert _family_imports(ROOT.parent / "benchmarks" / "_models.py")  # it imports the families' modules


@pytest.mark.parametrize("layer, allowed", [
    # the dense reference models know nothing of paging
    ("paged_kv_compile.models", ("paged_kv_compile.models",)),
    # warm-up and capture hold no family knowledge: they reach a model only through families/
    # (and the forward in progress only through the one object compiled code talks to: forward_context)
    ("paged_kv_compile.capture", ("paged_kv_compile.capture", "paged_kv_compile.families", "paged_kv_compile.binding",
                                  "paged_kv_compile.config", "paged_kv_compile.errors",
                                  "paged_kv_compile.forward_context")),
    # the per-forward object knows the plan's records and layouts, never the runtime, scheduler or a family module
    ("paged_kv_compile.forward_context", ("paged_kv_compile.config", "paged_kv_compile.errors",
                                          "paged_kv_compile.layout")),
    # the structural reading of a site (graph helpers <- tag execution <- provenance <- writes <- site) and the
    # idioms know no family, runtime or metadata
    ("paged_kv_compile.passes.graph", ()),
    ("paged_kv_compile.passes.tags", ("paged_kv_compile.passes.graph",)),
    ("paged_kv_compile.passes.provenance", ("paged_kv_compile.passes.graph", "paged_kv_compile.passes.tags")),
    ("paged_kv_compile.passes.writes", ("paged_kv_compile.passes.graph", "paged_kv_compile.passes.tags",
                                        "paged_kv_compile.passes.provenance")),
    ("paged_kv_compile.passes.site", ("paged_kv_compile.passes.graph", "paged_kv_compile.passes.tags",
                                      "paged_kv_compile.passes.provenance", "paged_kv_compile.passes.writes")),
    ("paged_kv_compile.passes.idioms", ("paged_kv_compile.passes.idioms", "paged_kv_compile.passes.site",
                                        "paged_kv_compile.passes.graph", "paged_kv_compile.passes.tags")),
    # the op's extra inputs are the pool's and the metadata's tensors, nothing else
    ("paged_kv_compile.passes.extra_inputs", ("paged_kv_compile.pool", "paged_kv_compile.metadata")),
    # the op and its kernels know nothing of runtimes, families or models
    ("paged_kv_compile.ops", ("paged_kv_compile.ops", "paged_kv_compile.config", "paged_kv_compile.errors")),
])
def test_layers_import_only_what_they_may(layer, allowed):
    bad = {m: sorted(d for d in deps if not (allowed and d.startswith(allowed)))
           for m, deps in _layer(layer).items()}
    bad = {m: d for m, d in bad.items() if d}
    assert not bad, f"{layer} imports outside its layer: {bad}"


def test_the_passes_import_no_family_registry():
    """The passes are handed the idioms they match (`rewrite(..., idioms=...)`, from the backend): a compile does not
    depend on whatever the registry holds when dynamo runs them, and no import runs back up the layers."""
    bad = {m: sorted(d for d in deps if d == "paged_kv_compile.families" or d.startswith("paged_kv_compile.families."))
           for m, deps in _layer("paged_kv_compile.passes").items()}
    bad = {m: d for m, d in bad.items() if d}
    assert not bad, f"passes/ imports the family registry: {bad}"


def test_the_registry_check_finds_a_planted_import(tmp_path):
    """The check above reads real edges: a module that imports the registry is one it would report."""
    planted = tmp_path / PACKAGE / "passes" / "planted.py"
    planted.parent.mkdir(parents=True)
    planted.write_text("from .. import families\n")
    modules = {f"{PACKAGE}.families", f"{PACKAGE}.passes.planted"}
    old_root = ROOT
    try:
        globals()["ROOT"] = tmp_path / PACKAGE
        assert _imports(planted, modules) == {f"{PACKAGE}.families"}
    finally:
        globals()["ROOT"] = old_root


def _module_names(tree: ast.AST, modules: set[str], package: str) -> set[str]:
    """Local names bound to a module by an import (`import torch`, `import a.b as c`, `from . import mod`)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.asname or a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            names.update(a.asname or a.name for a in node.names if f"{target}.{a.name}" in modules)
    return names


def module_attribute_assignments(source: str, modules: set[str] = frozenset(), package: str = PACKAGE) -> list[str]:
    """`mod.attr = ...` (and `+=`, `del`, `setattr(mod, ...)`) where `mod` names an imported module: one module
    changing another's state behind its back (a monkey-patch)."""
    tree = ast.parse(source)
    names = _module_names(tree, modules, package)
    found = []

    def base(target: ast.AST) -> str | None:
        while isinstance(target, ast.Attribute):
            target = target.value
        return target.id if isinstance(target, ast.Name) and target.id in names else None

    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr")
              and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id in names):
            found.append(f"line {node.lineno}: {node.func.id}({node.args[0].id}, ...)")
        for target in targets:
            if isinstance(target, ast.Attribute) and base(target):
                found.append(f"line {node.lineno}: {ast.unparse(target)}")
    return sorted(found, key=lambda hit: int(hit.split()[1].rstrip(":")))


def test_no_module_assigns_another_modules_attributes():
    """A module's state is changed through its functions, never by another module assigning to it."""
    paths = sorted(ROOT.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    bad = {}
    for path in paths:
        name = _module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        hits = module_attribute_assignments(path.read_text(), modules, package)
        if hits:
            bad[str(path.relative_to(ROOT))] = hits
    assert not bad, f"modules assign other modules' attributes: {bad}"


def test_the_assignment_check_finds_planted_ones():
    modules = {f"{PACKAGE}.ops", f"{PACKAGE}.ops.write_attend"}
    planted = ("import torch\nfrom .ops import write_attend as op\n"
               "torch._dynamo.config.cache_size_limit = 64\nop.CALLS += 1\nsetattr(op, 'X', 1)\ndel op.Y\n")
    assert module_attribute_assignments(planted, modules, PACKAGE) == [
        "line 3: torch._dynamo.config.cache_size_limit", "line 4: op.CALLS", "line 5: setattr(op, ...)",
        "line 6: op.Y"]
    clean = "import torch\nx = torch.zeros(1)\nx.data = torch.ones(1)\nself_attr = 1\n"
    assert module_attribute_assignments(clean, modules, PACKAGE) == []
