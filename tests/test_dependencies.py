"""Every module the packages import is a distribution pyproject.toml declares.

`flowmatch catalog neardup` and the demo import scipy (neardup's DCT), which only the dev
extra brought (through scikit-learn and scikit-image): an install of the package alone, the
image's `.[scale]` included, failed there with ModuleNotFoundError. Found by a newcomer's
reading; this test walks every import of both packages (inside functions too) and maps each
top-level module to the distributions installed here that provide it. What is declared is read
from the installed package's metadata (``importlib.metadata.requires``), so after editing
pyproject.toml run ``pip install -e .`` (scripts/install.sh) before this test."""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("flowmatch_assets", "flowmatch_models")
#: The extras a package import may come from: scale-out code imports its engines lazily. Not
#: dev (tests and examples only) and not gemma (weights, never imported by the code).
CODE_EXTRAS = ("scale",)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> set[str]:
    """The distributions the installed flowmatch requires: its dependencies and CODE_EXTRAS'
    (the metadata ``pip install`` made from pyproject.toml; stale until it is run again)."""
    names = set()
    for req in md.requires("flowmatch") or []:
        extra = re.search(r"""extra\s*==\s*["']([\w-]+)["']""", req)
        if extra is None or extra.group(1) in CODE_EXTRAS:
            names.add(_norm(re.split(r"[<>=!~\[ ;(]", req, maxsplit=1)[0]))
    return names


def imported(source: str) -> set[str]:
    """The top-level modules ``source`` imports (absolute imports, at any depth), but for an
    optional one: imported in a ``try`` that catches its ImportError with its own message."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Try) and any(_catches_import_error(h) for h in node.handlers):
            for child in [*node.handlers, *node.orelse, *node.finalbody]:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return out


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(
        isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError") for n in names
    )


def undeclared(modules: set[str], names: set[str], provides: dict[str, list[str]]) -> list[str]:
    """The third-party modules no declared distribution provides."""
    return sorted(
        m
        for m in modules
        if m not in sys.stdlib_module_names
        and not m.startswith("flowmatch_")
        and not any(_norm(d) in names for d in provides.get(m, []))
    )


def test_every_module_the_packages_import_is_declared():
    by_module: dict[str, set[str]] = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            for m in imported(f.read_text()):
                by_module.setdefault(m, set()).add(str(f.relative_to(ROOT)))
    missing = undeclared(set(by_module), declared(), md.packages_distributions())
    assert not missing, {m: sorted(by_module[m])[:3] for m in missing}


@pytest.mark.parametrize(
    "line",
    [
        "from scipy.fft import dctn",
        "import sklearn.cluster",
        "def f():\n    import skimage.data\n",
        # a try that catches something else does not make it optional
        "try:\n    import sklearn\nexcept ValueError:\n    pass\n",
    ],
)
def test_a_planted_undeclared_import_is_caught(line):
    names = declared() - {"scipy"}
    assert undeclared(imported(line), names, md.packages_distributions())


def test_an_optional_import_with_its_own_message_is_not_a_dependency():
    line = "try:\n    import sklearn\nexcept ImportError:\n    raise SystemExit('pip install')\n"
    assert imported(line) == set()
