"""The package layout: every module imports the modules below it and none imports back.

Reads the sources (ast), so it needs no GPU, CuPy or torch. Function-level imports count as
edges too: a lazy import that closes a cycle is still a cycle for a reader.
"""
import ast
import subprocess
import sys
from pathlib import Path

import cupyflash

ROOT = Path(cupyflash.__file__).resolve().parent


def _modules() -> dict:
    """{dotted module name: path} of every module of the package."""
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict) -> set:
    """The package modules ``name`` imports (each ``from X import y`` counts as X, or X.y when
    that is a module)."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "cupyflash"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "cupyflash":
                continue
            subs = {f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in modules}
            found |= subs or {mod}
            if len(subs) < len(node.names) and subs:
                found.add(mod)
    return {m for m in found if m in modules and m != name}


def test_no_import_cycles():
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    state: dict = {}

    def visit(m, stack):
        state[m] = "active"
        for n in sorted(graph[m]):
            if state.get(n) == "active":
                cycle = stack[stack.index(n):] + [n]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n, stack + [n])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_layout_shows_the_paths():
    """The prefill path, the decode path and the shared machinery each live in one package."""
    for pkg in ("forward", "decode", "core"):
        assert (ROOT / pkg / "__init__.py").is_file(), pkg
    kernels = ROOT.parent / "kernels_cu"
    for folder in ("forward", "decode", "common"):
        assert (kernels / folder).is_dir(), folder
    # the kernel launchers of a path live in that path's package, the generic ones in core
    modules = _modules()
    for m in modules:
        assert m.count(".") <= 2, m


def test_help_needs_neither_torch_nor_hypothesis():
    """``help(cupyflash)`` and ``pydoc`` read every name ``dir()`` lists: torch_ops and hf import
    torch, testing imports hypothesis, so none is listed before it is imported (each still
    imports on access). Run where neither torch nor hypothesis can be imported."""
    code = ("import sys, pydoc\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('torch', 'hypothesis', 'transformers'):\n"
            "            raise ImportError('blocked: ' + name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "import cupyflash\n"
            "names = set(dir(cupyflash))\n"
            "assert not names & {'torch_ops', 'hf', 'testing'}, names\n"
            "assert {'flash_attn_func', 'flash_attn_with_kvcache', 'reference', 'forward',"
            " 'decode', 'core'} <= names, names\n"
            "text = pydoc.render_doc(cupyflash)\n"
            "assert 'flash_attn_func' in text\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT.parent)
