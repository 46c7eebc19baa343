"""What a recorded figure depends on, hashed by substance: a result is stale when that code changed.

Each benchmark declares the code and data its figure depends on beyond what its own process imports
(``DEPENDS_ON``: globs from the repository's root, such as the runtime its role processes run or
the control plane its clusters serve through). ``code_record`` notes, as the result is written, a
hash of each file those globs match and of each repository module the benchmark's process imported
(but the writer's own, ``RECORDERS``, which no figure depends on).
``changed`` compares a recorded note with the tree as it is now: the files whose substance differs,
the ones gone, and the ones the globs match now that they did not.

Substance, not bytes: a Python file is hashed from its syntax tree with docstrings left out (comments
are not in it), so a comment or docstring fix stales nothing while a change of behaviour stales
every result that depends on it; a JSON file from its canonical form; any other file from its bytes.
The hash needs only the file as it is, so a shallow clone judges staleness as well as a full one.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HASH_CHARS = 16  # 64 bits of SHA-256 each: enough to tell a change, short enough to keep per file
# The groups benchmarks name in ``DEPENDS_ON``: what runs in processes the benchmark starts.
RUNTIME = ("inference/**/*.py",)  # the roles (main, shadow, workers) a local cluster runs
PLATFORM = (*RUNTIME, "platform/controlplane/**/*.py", "agent/**/*.py")  # the control plane and the agents
SKIPPED_TOP = frozenset({".venv", "var", "build", "node_modules"})  # never the project's own code
# The modules that write a result down: every benchmark imports them, and none of its figures
# depends on them, so they never make a result stale (results recorded with them list them too).
RECORDERS = frozenset({"benchmarks/provenance.py", "benchmarks/substance.py"})


def _without_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        first = node.body[0] if node.body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            node.body = node.body[1:] or [ast.Pass()]
    return tree


def substance(path: Path) -> str:
    """The hash of ``path``'s substance (see the module's docstring); "unreadable" for a file that
    cannot be read or parsed, which then differs from any recorded hash of a readable one. Kept per
    file version (its modification time and size), as the pages judge many results on the same files."""
    try:
        stat = path.stat()
    except OSError:
        return "unreadable"
    return _substance(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4096)
def _substance(path: Path, mtime_ns: int, size: int) -> str:
    try:
        data = path.read_bytes()
        if path.suffix == ".py":
            tree = _without_docstrings(ast.parse(data, filename=str(path)))
            text = ast.dump(tree, annotate_fields=True, include_attributes=False).encode()
        elif path.suffix == ".json":
            text = json.dumps(json.loads(data), sort_keys=True, separators=(",", ":")).encode()
        else:
            text = data
    except (OSError, SyntaxError, ValueError):
        return "unreadable"
    return hashlib.sha256(text).hexdigest()[:HASH_CHARS]


def _ours(path: Path) -> str | None:
    """``path`` relative to the repository when it is the project's own file, else None."""
    try:
        relative = path.resolve().relative_to(REPO)
    except ValueError:
        return None
    return None if not relative.parts or relative.parts[0] in SKIPPED_TOP else relative.as_posix()


def matched(globs: tuple[str, ...] | list[str]) -> set[str]:
    """The project's files that ``globs`` match now."""
    return {name for pattern in globs for path in REPO.glob(pattern) if path.is_file() and (name := _ours(path))}


def imported() -> set[str]:
    """The project's Python files this process has imported."""
    found = set()
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if file and file.endswith(".py") and (name := _ours(Path(file))):
            found.add(name)
    return found - RECORDERS


def code_record(depends_on: tuple[str, ...]) -> dict:
    """What a result records of its code: the declared globs and each file's substance hash, those
    files being the globs' matches and the project's modules this process imported."""
    files = sorted(matched(depends_on) | imported())
    return {"depends_on": list(depends_on), "files": {name: substance(REPO / name) for name in files}}


def changed(code: dict) -> list[str]:
    """The files of a recorded ``code_record`` whose substance differs now, as "path", "path (gone)"
    or "path (new)" (a file its globs match now that they did not), sorted."""
    files: dict[str, str] = code.get("files") or {}
    differ = [
        name if (REPO / name).is_file() else f"{name} (gone)"
        for name, recorded in files.items()
        if name not in RECORDERS and substance(REPO / name) != recorded
    ]
    new = [f"{name} (new)" for name in matched(code.get("depends_on") or []) if name not in files]
    return sorted(differ + new)
