"""The package layout as docs/design/architecture.md draws it: which package may import which, no cycles, no
library module reaching into the CLI, no private names across modules, short files and functions.

Read from the sources with `ast` (nothing is imported), so a violation names its file and line.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "thunderep"

# package -> the packages its modules may import (besides itself). The top level (config, errors and
# the public API in __init__) is "thunderep"; `env` reads the THUNDEREP_* switches.
ALLOWED = {
    "errors": set(),
    "env": {"errors"},
    "config": {"errors"},
    "kernels": {"errors", "env", "config"},
    "comm": {"errors", "env", "config", "kernels"},
    "balance": {"errors", "env", "config", "comm"},
    "moe": {"errors", "env", "config", "kernels", "comm", "balance"},
    "hf": {"errors", "env", "config", "kernels", "comm", "balance", "moe"},
    "train": {"errors", "env", "config", "kernels", "comm", "balance", "moe", "hf"},
    "serve": {"errors", "env", "config", "kernels", "comm", "balance", "moe", "hf", "train"},
    "doctor": {"errors", "env", "config", "kernels", "comm"},
    "sysconfig": {"errors", "env", "config", "doctor"},
    "bench": {"errors", "env", "config", "kernels", "comm", "balance", "moe", "hf", "train", "serve", "doctor"},
    "cli": {"errors", "env", "config", "kernels", "comm", "balance", "moe", "hf", "train", "serve", "doctor",
            "sysconfig", "bench", "thunderep"},
    "thunderep": {"errors", "config", "comm", "balance", "moe"},  # __init__: the public API
}

# Imports inside functions are for these (optional or GPU-only dependencies), or carry a comment saying
# why (a measured start-up cost, a dependency that may be absent).
OPTIONAL = {"transformers", "safetensors", "triton", "cupy", "pycuda", "accelerate", "compressed_tensors",
            "huggingface_hub", "tokenizers", "numpy", "matplotlib", "fastapi", "uvicorn", "pydantic",
            "starlette", "tqdm"}
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80


@dataclass(frozen=True)
class Import:
    module: str  # importing module, dotted
    target: str  # imported module (or module.name where the name is not a module), dotted
    names: tuple[str, ...]
    line: int
    deferred: bool  # inside a function
    commented: bool  # a comment on its line or the line before


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(module: str, path: Path) -> list[Import]:
    source = path.read_text()
    lines = source.splitlines()
    is_pkg = path.name == "__init__.py"
    out = []

    def commented(node) -> bool:
        here = lines[node.lineno - 1]
        before = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
        return "#" in here or before.startswith("#")

    def visit(node, deferred):
        for child in ast.iter_child_nodes(node):
            inside = deferred or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.ImportFrom):
                if child.level:
                    base = module.split(".") if is_pkg else module.split(".")[:-1]
                    base = base[:len(base) - child.level + 1]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                out.append(Import(module, target, tuple(a.name for a in child.names), child.lineno, deferred,
                                  commented(child)))
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    out.append(Import(module, alias.name, (), child.lineno, deferred, commented(child)))
            visit(child, inside)

    visit(ast.parse(source), False)
    return out


IMPORTS = [i for m, p in MODULES.items() for i in _imports(m, p)]


def _internal(imp: Import) -> list[str]:
    """The thunderep modules an import reaches: the target, or target.name for names that are modules."""
    if not imp.target.startswith("thunderep"):
        return []
    mods = [f"{imp.target}.{n}" for n in imp.names if f"{imp.target}.{n}" in MODULES]
    plain = [n for n in imp.names if f"{imp.target}.{n}" not in MODULES]
    if plain or not imp.names:
        target = imp.target
        while target not in MODULES and "." in target:
            target = target.rsplit(".", 1)[0]
        mods.append(target)
    return mods


def _package(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "thunderep"
    return parts[1]


def _where(imp: Import) -> str:
    return f"{MODULES[imp.module].relative_to(ROOT.parent)}:{imp.line}"


def test_the_top_level_keeps_config_errors_env_and_the_public_api():
    top = sorted(m for m, p in MODULES.items() if m.count(".") == 1 and p.name != "__init__.py")
    assert top == ["thunderep.config", "thunderep.env", "thunderep.errors"]


def test_every_package_imports_only_the_packages_below_it():
    bad = []
    for imp in IMPORTS:
        src = _package(imp.module)
        for target in _internal(imp):
            dst = _package(target)
            if dst != src and dst not in ALLOWED[src]:
                bad.append(f"{_where(imp)} ({src}) imports {target} ({dst})")
    assert not bad, "\n".join(bad)


def test_no_import_cycles_between_modules_deferred_imports_included():
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for imp in IMPORTS:
        for target in _internal(imp):
            # a package's __init__ re-exporting its own modules is not a cycle of the design
            if target != imp.module and not (MODULES[imp.module].name == "__init__.py"
                                             and target.startswith(imp.module + ".")):
                graph[imp.module].add(target)
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            strong(v)
    assert not cycles, cycles


def test_no_library_module_imports_the_cli_or_parses_arguments():
    bad = [f"{_where(i)} imports {i.target}" for i in IMPORTS
           if _package(i.module) != "cli" and (i.target == "argparse" or any(
               t == "thunderep.cli" or t.startswith("thunderep.cli.") for t in _internal(i)))]
    for module, path in MODULES.items():
        if _package(module) != "cli" and re.search(r"\bNamespace\b", path.read_text()):
            bad.append(f"{path.relative_to(ROOT.parent)} names Namespace")
    assert not bad, "\n".join(bad)


def test_no_private_names_imported_across_modules():
    bad = [f"{_where(i)} imports {n} from {i.target}" for i in IMPORTS if i.target.startswith("thunderep")
           for n in i.names if n.startswith("_") and not n.startswith("__")
           and n not in ("_mailbox_native", "_probe_native", "_host_native")]
    assert not bad, "\n".join(bad)


def test_imports_inside_functions_are_optional_dependencies_or_say_why():
    bad = [f"{_where(i)} imports {i.target} inside a function without a comment" for i in IMPORTS
           if i.deferred and not i.commented and i.target.split(".")[0] not in OPTIONAL]
    assert not bad, "\n".join(bad)


def test_the_thunderep_environment_switches_are_read_in_one_module():
    pattern = re.compile(r"""(environ(\.get)?\s*[\[(]\s*|getenv\(\s*)["']THUNDEREP_""")
    bad = [f"{path.relative_to(ROOT.parent)}:{n}" for module, path in MODULES.items() if module != "thunderep.env"
           for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not bad, "\n".join(bad)


def test_files_are_at_most_500_lines():
    long = {str(p.relative_to(ROOT.parent)): n for p in MODULES.values()
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not long, long


def _is_triton_kernel(node) -> bool:
    return any("jit" in ast.unparse(d) for d in node.decorator_list)


def test_functions_are_at_most_80_lines_triton_kernels_excepted():
    long = {}
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_triton_kernel(node):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name}"] = n
    assert not long, long


@pytest.mark.parametrize("package", sorted(p for p in ALLOWED if p not in ("thunderep", "errors", "env", "config")))
def test_each_package_has_a_test_folder(package):
    assert (ROOT.parent / "tests" / package).is_dir(), f"tests/{package}/ mirrors thunderep/{package}/"
