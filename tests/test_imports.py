"""The house rules on imports, checked over whatever the packages hold when the test runs:

* no import circle between the project's modules (imports inside functions count: a lazy import
  hides a circle from Python, not from the reader);
* every module imports alone (a fresh set of project modules each time, in one interpreter: the
  third-party libraries stay loaded, so this takes seconds, not one interpreter per module);
* no private name (``_x``) used outside the module that defines it: no ``from m import _x``, no
  import of a private module (``torch.optim._muon``), no ``obj._x`` where ``_x`` is defined only
  in other project modules.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("krea2_diffusers", "finetune", "curation", "comfy_nodes", "train_tab")


def _modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the packages (``__main__`` modules excepted: they run)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__main__":
                continue
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[ast.AST, str | None, list[str]]]:
    """(node, the module it imports from or None, the names it imports) for every import of the file."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node, None, [a.name]) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            source = ".".join(base + ([node.module] if node.module else []))
            found.append((node, source, [a.name for a in node.names]))
    return found


def _project_module(dotted: str, modules: dict[str, Path]) -> str | None:
    while dotted and dotted not in modules:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        edges = set()
        for _, source, names in _imports(name, path, modules):
            if source is None:
                targets = names
            else:  # `from p import sub` needs p.sub (p itself is the importer's parent or another module)
                targets = [f"{source}.{n}" if f"{source}.{n}" in modules else source for n in names]
            edges |= {t for t in map(lambda d: _project_module(d, modules), targets) if t and t != name}
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_every_package_is_installed_and_checked():
    """Each top-level package of the checkout is in pyproject's install list and in PACKAGES (a
    package missing from the first is absent from a wheel; from the second, unchecked here)."""
    import tomllib

    on_disk = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert {pattern.rstrip("*") for pattern in include} == on_disk
    assert set(PACKAGES) == on_disk


def test_no_import_circle_between_the_projects_modules():
    graph = _graph()
    assert len(graph) > 100 and "krea2_diffusers.models.transformer" in graph
    assert _cycles(graph) == []


IMPORT_EACH = """
import importlib, sys, traceback
packages = {packages!r}
for heavy in ("torch", "diffusers", "transformers", "accelerate", "peft", "safetensors", "PIL", "numpy", "yaml"):
    try:
        importlib.import_module(heavy)
    except ImportError:
        pass
failures = []
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m.split(".")[0] in packages]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except BaseException:
        failures.append(name + ": " + traceback.format_exc(limit=-3))
print("\\n".join(failures))
sys.exit(1 if failures else 0)
"""


def test_every_module_imports_alone():
    names = sorted(_modules())
    done = subprocess.run([sys.executable, "-c", IMPORT_EACH.format(packages=PACKAGES), *names], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _definitions(tree: ast.AST) -> set[str]:
    """Private names a module defines: functions, classes, assignments, attributes it sets."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.keyword) and node.arg:  # e.g. argparse's set_defaults(_run=...)
            names.add(node.arg)
    return {n for n in names if _private(n)}


def private_names_used_across_modules() -> list[str]:
    modules = _modules()
    trees = {name: ast.parse(path.read_text(), str(path)) for name, path in modules.items()}
    defined = {name: _definitions(tree) for name, tree in trees.items()}
    everywhere = set().union(*defined.values())
    found = []
    for name, tree in trees.items():
        where = modules[name].relative_to(ROOT)
        for node, source, names in _imports(name, modules[name], modules):
            private_modules = [p for n in ([source] if source else names) for p in n.split(".") if _private(p)]
            if private_modules:
                found.append(f"{where}:{node.lineno} imports the private module {source or names[0]}")
            found += [f"{where}:{node.lineno} imports {n} from {source}" for n in names if source and _private(n)]
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
                continue
            if node.attr in everywhere and node.attr not in defined[name]:
                found.append(f"{where}:{node.lineno} uses {ast.unparse(node)}, defined in another module")
    return found


def test_no_private_name_is_used_outside_its_module():
    assert private_names_used_across_modules() == []
