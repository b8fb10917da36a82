"""The house rules a newcomer can rely on: which folders may import Dagster, and no import
cycles in either package (an import inside a function counts, and so does one under ``if
TYPE_CHECKING:``: a cycle of type hints is a cycle a reader has to untangle)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("flowmatch_assets", "flowmatch_models")

#: The only places in flowmatch_assets that may import dagster: the definitions (defs/), the
#: code locations, the in-process runs the CLI and tests call, the CLI, what reads or writes
#: the Dagster instance (freshness/), the one module of private Dagster APIs, and benchmarks of
#: the orchestration. ingest/, catalog/, reports/ and demo/ are plain libraries.
DAGSTER_ALLOWED = (
    "flowmatch_assets/defs/",
    "flowmatch_assets/cli/",
    "flowmatch_assets/freshness/",
    "flowmatch_assets/bench/",
    "flowmatch_assets/definitions.py",
    "flowmatch_assets/definitions_k8s.py",
    "flowmatch_assets/runs.py",
    "flowmatch_assets/compat.py",
)


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in sorted((REPO / pkg).rglob("*.py")):
            parts = list(p.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = p
    return out


def _imports(path: Path, module: str, source: str | None = None) -> list[str]:
    """Every module ``path`` imports, anywhere in it (``if TYPE_CHECKING:`` blocks included)."""
    tree = ast.parse(source if source is not None else path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative
                pkg = module.split(".")[: -node.level + (path.name == "__init__.py") or None]
                base = ".".join([*pkg, base] if base else pkg)
            out.append(base)
            out += [f"{base}.{a.name}" for a in node.names]
    return out


def test_only_the_wiring_folders_import_dagster():
    offenders = []
    for module, path in _modules().items():
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith("flowmatch_assets") and rel.startswith(DAGSTER_ALLOWED):
            continue
        tops = {m.split(".")[0] for m in _imports(path, module)}
        uses = {t for t in tops if t == "dagster" or t.startswith("dagster_")}
        if rel == "flowmatch_models/train/run.py":
            uses -= {"dagster_pipes"}  # the training process's end of Pipes (not Dagster itself)
        if uses:
            offenders.append(f"{rel}: {sorted(set(uses))}")
    assert not offenders, "Dagster imported outside the wiring folders:\n" + "\n".join(offenders)


def test_private_dagster_apis_only_in_compat():
    """``dagster._*`` and the instance's storages are reached only through compat.py (its
    tests fail loudly on the Dagster version that changes them)."""
    offenders = []
    for module, path in _modules().items():
        if module == "flowmatch_assets.compat":
            continue
        private = [m for m in _imports(path, module) if m.startswith("dagster._")]
        if private or "_storage." in path.read_text():
            offenders.append(f"{path.relative_to(REPO)}: {private or 'instance storage'}")
    assert not offenders, "private Dagster API outside flowmatch_assets/compat.py:\n" + "\n".join(
        offenders
    )


def _graph(planted: dict[str, str] | None = None) -> dict[str, set[str]]:
    """Module -> the modules it imports; ``planted``: module -> extra source appended to it."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for module, path in mods.items():
        deps = set()
        extra = (planted or {}).get(module)
        src = path.read_text() + ("\n" + extra if extra else "")
        for imp in _imports(path, module, src):
            # the longest known module the import names (``a.b.c`` may be a name in ``a.b``)
            while imp and imp not in mods:
                imp = imp.rpartition(".")[0]
            if imp and imp != module and not module.startswith(imp + "."):
                deps.add(imp)
        graph[module] = deps
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return stack[stack.index(d) :] + [d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_import_graph_has_no_cycle():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("pkg", PACKAGES)
def test_the_cycle_finder_finds_one(pkg):
    """The walker itself: a planted cycle is found (so a passing test above means something)."""
    graph = {k: set(v) for k, v in _graph().items() if k.startswith(pkg)}
    a, b = sorted(graph)[:2]
    graph[a].add(b)
    graph[b].add(a)
    assert _cycle(graph)


def test_a_type_checking_import_counts():
    """A cycle made only of a type hint's import is found: the import under ``if TYPE_CHECKING:``
    that once hid ``embeddings -> encoder_spec -> embeddings``."""
    plant = "if TYPE_CHECKING:\n    from flowmatch_models.embeddings.kinds import EmbeddingKind\n"
    cycle = _cycle(_graph({"flowmatch_models.encoders.spec": plant}))
    assert cycle is not None and "flowmatch_models.encoders.spec" in cycle


def _defs_imports_of_freshness(planted: dict[str, str] | None = None) -> dict[str, list[str]]:
    """freshness/ module -> what it imports from defs/ (``planted``: module -> extra source)."""
    out = {}
    for module, path in _modules().items():
        if not module.startswith("flowmatch_assets.freshness"):
            continue
        src = path.read_text() + (planted or {}).get(module, "")
        bad = sorted(
            {m for m in _imports(path, module, src) if m.startswith("flowmatch_assets.defs")}
        )
        if bad:
            out[module] = bad
    return out


def test_freshness_imports_nothing_from_defs():
    """What is stale depends on the settings, not on the Dagster resource class: freshness/
    takes a ``freshness.settings.Settings`` (the resource is one) and never imports defs/."""
    found = _defs_imports_of_freshness()
    assert not found, f"freshness/ imports defs/ (take the settings as an argument): {found}"


def test_a_defs_import_planted_in_freshness_is_found():
    plant = "def f():\n    from flowmatch_assets.defs.resources import resource_from_env\n"
    found = _defs_imports_of_freshness({"flowmatch_assets.freshness.state": plant})
    assert found == {
        "flowmatch_assets.freshness.state": [
            "flowmatch_assets.defs.resources",
            "flowmatch_assets.defs.resources.resource_from_env",
        ]
    }
