"""The package's import graph follows the pipeline (issue: layout).

Stages run one way: common → core → data, models → weights → encoding → tasks → training,
indexing → retrieval → evaluation, serving → binaries (the top-level modules). A module may import its own
package and any earlier stage, never a later one or a sibling of its own stage; there is no import
cycle, counting function-local imports; and a function-local import exists only to keep a heavy
optional dependency off the import path, with a one-line reason beside it.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "aligner_jax"

STAGES = {
    "common": 0,
    "core": 1,
    "data": 2,
    "models": 2,
    "weights": 3,
    "encoding": 4,
    "tasks": 5,
    "training": 6,
    "indexing": 6,
    "lexical": 6,
    "retrieval": 7,
    "evaluation": 8,
    "serving": 8,
}
BINARY_STAGE = 9
# Function-local imports are allowed only for these (TensorFlow, plotting, optional tokenisers).
HEAVY = {
    "scann",
    "seqio",
    "clu",
    "matplotlib",
    "torch",
    "tensorflow",
    "tensorstore",
    "sentencepiece",
    "qdrant_client",  # the optional extra aligner_jax[qdrant] (a Qdrant server)
}
HEAVY_OWN = {"aligner_jax.tasks"}  # importing registers seqio tasks (imports TensorFlow)


def _source_files() -> dict[str, Path]:
    files = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        files[name] = path
    for path in sorted((REPO / "tasks").glob("*.py")):
        stem = path.stem
        files["aligner_jax.tasks" if stem == "__init__" else f"aligner_jax.tasks.{stem}"] = path
    return files


FILES = _source_files()


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute name ``from node.module`` refers to in ``module`` (``from ..x import y``
    counted like ``from aligner_jax.x import y``), so that no import escapes the checks."""
    if node.level == 0:
        return node.module
    parts = module.split(".") if is_package else module.split(".")[:-1]
    if node.level - 1 >= len(parts):
        raise AssertionError(f"{module}: relative import beyond the top-level package")
    base = parts[: len(parts) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(path: Path, module: str | None = None):
    """(imported module, is_local, line text) for every import in the file; relative ones are
    resolved against ``module`` (the file's dotted name, by default from FILES)."""
    if module is None:
        module = next(name for name, p in FILES.items() if p == path)
    tree = ast.parse(path.read_text())
    lines = path.read_text().splitlines()
    local_nodes = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            for inner in ast.walk(node):
                if inner is not node and isinstance(inner, ast.Import | ast.ImportFrom):
                    local_nodes.add(id(inner))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(node, module, path.name == "__init__.py")
            names = []
            for alias in node.names:
                candidate = f"{source}.{alias.name}"
                names.append(candidate if candidate in FILES else source)
        else:
            continue
        for name in names:
            yield name, id(node) in local_nodes, lines[node.lineno - 1]


def _stage(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 2 and parts[1] not in STAGES:
        return BINARY_STAGE  # a top-level module is a binary
    return STAGES[parts[1]] if len(parts) > 1 else BINARY_STAGE


def _graph() -> dict[str, set[str]]:
    graph = {}
    for module, path in FILES.items():
        graph[module] = {
            name
            for name, _, _ in _imports(path)
            if name.startswith("aligner_jax.") and name in FILES
        }
    return graph


def _package_of(module: str) -> str | None:
    """The stage package a module lives in (a package's ``__init__`` is its own), else None."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) >= 2 and parts[1] in STAGES else None


def backward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, imported in graph.items():
        if module == "aligner_jax":
            continue  # the lazy public API
        package = _package_of(module)
        for target in imported:
            if package is not None and _package_of(target) == package:
                continue
            if package is None and _stage(target) == BINARY_STAGE:
                bad.append(f"{module} -> {target} (a binary importing another binary)")
            elif package is not None and _stage(target) >= _stage(module):
                bad.append(f"{module} (stage {_stage(module)}) -> {target} ({_stage(target)})")
    return sorted(bad)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state, stack, found = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_every_module_belongs_to_a_stage():
    for module in FILES:
        parts = module.split(".")
        if len(parts) > 2:
            assert parts[1] in STAGES, f"{module}: subpackage {parts[1]!r} is not a pipeline stage"
            assert len(parts) == 3, f"{module}: subpackages are one level deep"


def test_no_import_from_a_later_stage_or_a_sibling_stage():
    bad = backward_imports(_graph())
    assert not bad, "imports against the pipeline order:\n" + "\n".join(bad)


def test_core_imports_nothing_but_the_error_types():
    for module, imported in _graph().items():
        if module.startswith("aligner_jax.core."):
            others = {t for t in imported if not t.startswith("aligner_jax.core.")}
            assert others <= {"aligner_jax.common.errors"}, f"{module} imports {others}"


def test_no_import_cycles():
    found = cycles(_graph())
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)


def test_local_imports_only_for_heavy_dependencies_with_a_reason():
    bad = []
    for module, path in FILES.items():
        if module == "aligner_jax":
            continue  # the public API imports lazily on purpose
        for name, is_local, line in _imports(path):
            if not is_local:
                continue
            heavy = name.split(".")[0] in HEAVY or name in HEAVY_OWN
            reason = "#" in line and line.split("#", 1)[1].replace("noqa: PLC0415", "").strip()
            if not heavy or not reason:
                bad.append(f"{path.relative_to(REPO)}: {line.strip()}")
    assert not bad, "function-local imports without a heavy dependency or a reason:\n" + "\n".join(
        bad
    )


@pytest.mark.parametrize(
    "binary", sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
)  # every top-level module is a binary, new ones included
def test_binaries_are_thin(binary):
    lines = (PACKAGE / f"{binary}.py").read_text().splitlines()
    assert len(lines) <= 80, f"aligner_jax/{binary}.py has {len(lines)} lines (a binary is ≤ 80)"


def test_the_checks_catch_a_cycle_and_a_backward_import():
    fake = {
        "aligner_jax.core.scoring": {"aligner_jax.retrieval.searcher"},
        "aligner_jax.retrieval.searcher": {"aligner_jax.core.scoring"},
        "aligner_jax.training.trainer": {"aligner_jax.indexing.indexer"},
        "aligner_jax.evaluate": {"aligner_jax.train"},
    }
    assert cycles(fake) == [
        ["aligner_jax.core.scoring", "aligner_jax.retrieval.searcher", "aligner_jax.core.scoring"]
    ]
    assert backward_imports(fake) == [
        "aligner_jax.core.scoring (stage 1) -> aligner_jax.retrieval.searcher (7)",
        "aligner_jax.evaluate -> aligner_jax.train (a binary importing another binary)",
        "aligner_jax.training.trainer (stage 6) -> aligner_jax.indexing.indexer (6)",
    ]


def test_relative_imports_are_checked_like_absolute_ones(tmp_path):
    source = tmp_path / "searcher.py"
    source.write_text(
        "from . import scoring_glue\n"
        "from ..training import trainer\n"
        "from ..core.scoring import alignment_scores\n"
        "def f():\n"
        "    from .. import train\n"
    )
    found = [(name, local) for name, local, _ in _imports(source, "aligner_jax.retrieval.searcher")]
    assert found == [
        ("aligner_jax.retrieval", False),
        ("aligner_jax.training.trainer", False),
        ("aligner_jax.core.scoring", False),
        ("aligner_jax.train", True),
    ]
    package = tmp_path / "__init__.py"
    package.write_text("from .searcher import Searcher\n")
    assert [n for n, _, _ in _imports(package, "aligner_jax.retrieval")] == [
        "aligner_jax.retrieval.searcher"
    ]
    package.write_text("from ... import x\n")
    with pytest.raises(AssertionError, match="beyond the top-level package"):
        list(_imports(package, "aligner_jax.retrieval"))


def test_public_api_is_lazy_and_complete():
    code = (
        "import sys, aligner_jax\n"
        "assert 'jax' not in sys.modules and 'aligner_jax.evaluation' not in sys.modules\n"
        "from aligner_jax import Encoder, Searcher, TokenStore, evaluate_beir, load_encoder, train_model\n"
        "print(Searcher.__module__, TokenStore.__module__, evaluate_beir.__module__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [
        "aligner_jax.retrieval.searcher",
        "aligner_jax.indexing.token_store",
        "aligner_jax.evaluation.beir_eval",
    ]


@pytest.mark.parametrize("preset", [None, "28"])
def test_package_sets_openblas_thread_timeout_before_numpy_loads(preset):
    """``import aligner_jax`` (what every binary imports first) sets OpenBLAS's worker timeout
    before NumPy loads (OpenBLAS reads it then), and keeps a value the user set."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    if preset is not None:
        env["OPENBLAS_THREAD_TIMEOUT"] = preset
    code = (
        "import os, sys, aligner_jax\n"
        "assert 'numpy' not in sys.modules\n"
        "print(os.environ['OPENBLAS_THREAD_TIMEOUT'])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.strip() == (preset or "4")


def _blas_child(script: str, *args: str) -> subprocess.CompletedProcess:
    """``python -c script args`` with 2 OpenBLAS threads and no ``OPENBLAS_THREAD_TIMEOUT``
    (OpenBLAS's default timeout unless the package sets it first); it must exit 0."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    env["OPENBLAS_NUM_THREADS"] = "2"
    out = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out


BLAS_SCRIPT = """
import sys
first = sys.argv[1]
if first == "numpy":
    import numpy as np
import aligner_jax
import numpy as np
from aligner_jax.common import blas
np.ones((64, 64)) @ np.ones((64, 64))  # OpenBLAS loaded and used
print(len(blas.spinning_openblas()))
blas.warn_if_spinning()
blas.warn_if_spinning()
"""


@pytest.mark.parametrize("first", ["aligner_jax", "numpy"])
def test_openblas_loaded_before_the_package_is_found_and_named_once(first):
    """NumPy imported before ``aligner_jax`` loads OpenBLAS with workers that spin after each
    search (the package's timeout comes too late): ``blas.spinning_openblas`` finds it by asking
    the library itself, and ``warn_if_spinning`` (``Searcher.load``'s) says so once, with the
    fix. Imported after, nothing to say."""
    out = _blas_child(BLAS_SCRIPT, first)
    spinning = first == "numpy"
    assert out.stdout.split() == ["1" if spinning else "0"]
    warnings = [line for line in out.stderr.splitlines() if "OPENBLAS_THREAD_TIMEOUT=4" in line]
    assert len(warnings) == (1 if spinning else 0), out.stderr[-2000:]
    if spinning:
        assert "Import aligner_jax before numpy" in warnings[0]


LIMIT_SCRIPT = """
import aligner_jax
import numpy as np
import threadpoolctl
from aligner_jax.common import blas
threadpoolctl.threadpool_limits(1)  # what a binary's --threads=1 does, NumPy loaded
import scipy.linalg  # SciPy's own OpenBLAS, loaded after the limit (Searcher.load loads it)
print(len(threadpoolctl.threadpool_info()), blas.threads())
"""


def test_threads_follow_the_limit_when_a_blas_library_loads_after_it():
    """``--threads=1`` limits the BLAS libraries loaded then; SciPy's own OpenBLAS, loaded later
    by ``Searcher.load``, keeps a thread per core. The search's thread count is the limit set,
    not the late library's default (it was: stage 2 ran on 2 threads under ``--threads=1``)."""
    out = _blas_child(LIMIT_SCRIPT)
    libraries, threads = map(int, out.stdout.split())
    assert libraries >= 1 and threads == 1


QUIET_SCRIPT = """
import sys
if sys.argv[1] == "numpy":
    import numpy as np
import aligner_jax
import numpy as np
import threadpoolctl
from aligner_jax.common import blas
a, b = np.random.default_rng(0).normal(size=(2, 1500, 64)).astype(np.float32)
want = a @ b.T  # OpenBLAS loaded and used
counts = lambda: [lib.num_threads for lib in blas._blas()]
with threadpoolctl.threadpool_limits(1):  # the first query under a limit of one thread
    with blas.one_thread_if_spinning():
        pass
before = counts()
with blas.one_thread_if_spinning():
    inside, limit = counts(), blas.threads()
    got = blas.matmul(a, b.T, np.empty_like(want))
print(len(blas.spinning_openblas()), before, inside, limit, counts(), bool((got == want).all()))
"""


@pytest.mark.parametrize("first", ["aligner_jax", "numpy"])
def test_a_search_holds_spinning_openblas_at_one_thread_and_gives_it_back(first):
    """NumPy imported first leaves OpenBLAS's idle workers spinning: while a query runs
    (``one_thread_if_spinning``), the library itself reports one thread (a call wakes no
    worker), ``blas.threads`` still the limit before, and ``blas.matmul`` cut between those
    threads gives the same product; after, the library has its count back, a first query under a
    limit of one thread notwithstanding. The package first: nothing to hold."""
    out = _blas_child(QUIET_SCRIPT, first)
    spinning = first == "numpy"
    want = f"{int(spinning)} [2] [{1 if spinning else 2}] 2 [2] True"
    assert out.stdout.strip() == want
