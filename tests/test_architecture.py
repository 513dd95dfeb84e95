"""The house rules of docs/architecture.md, checked on the source: imports point down only (flows →
tasks → models), no import circles, and the plain work imports without Prefect."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("models", "tasks", "flows")
LAYER = {"models": 0, "tasks": 1, "flows": 2}


def module_files() -> dict[str, Path]:
    """Every module of the three packages, by dotted name (a package by its ``__init__``)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports_of(path: Path, name: str, modules: set[str]) -> set[str]:
    """The project's modules that ``name`` imports anywhere in its file (inside functions too: a
    deferred import is still a dependency, and still closes a circle)."""
    is_package = path.name == "__init__.py"
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = name.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join([*base, node.module] if node.module else base)
            else:
                origin = node.module or ""
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod.
            for alias in node.names:
                targets.add(f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in modules else origin)
    return {t for t in targets if t in modules and t != name}


def graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imports_of(path, name, set(files)) for name, path in files.items()}


def test_the_graph_sees_the_project() -> None:
    edges = graph()
    assert "tasks.jobs.launchers.slurm" in edges
    assert "tasks.jobs.launchers.base" in edges["tasks.jobs.launchers.slurm"]
    assert "models.mlstm" in edges["tasks.pretrain.train"]


def test_imports_point_down_only() -> None:
    upward = [
        f"{source} imports {target}"
        for source, targets in graph().items()
        for target in targets
        if LAYER[target.split(".")[0]] > LAYER[source.split(".")[0]]
    ]
    assert not upward, (
        "models/ imports nothing from tasks/ or flows/, tasks/ nothing from flows/: " + "; ".join(upward)
    )


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each a circle of imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(edges[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_the_job_is_run_not_imported() -> None:
    """The training job is a program torchrun starts; the side that plans, launches and watches it
    shares its settings (tasks/pretrain/config.py) and its log lines (joblog.py), never the job module,
    which loads torch and the whole trainer."""
    importers = sorted(source for source, targets in graph().items() if "tasks.pretrain.train" in targets)
    assert importers == []


# Inside tasks/: the ground floor every stage stands on, the job runtime above it, then the stages side
# by side, and the pipeline's bookkeeping on top.
GROUND = (
    "tasks.processes",
    "tasks.registered",
    "tasks.secrets",
    "tasks.settings",
    "tasks.signing",
    "tasks.store",
    "tasks.tracking",
)
RUNTIME = "tasks.jobs"
STAGES = ("tasks.corpus", "tasks.pretrain", "tasks.finetune", "tasks.transfer", "tasks.score", "tasks.sweep")
# The longest chain of packages inside tasks/, each importing the next (secrets → settings → store →
# corpus → pretrain → sweep → pipeline). It was 8 while the job runtime lived in tasks/pretrain/ and
# fine-tuning stood on it: a new stage should not raise it.
MAX_FLOORS = 7


def package_of(module: str) -> str:
    """``tasks.pretrain.train`` → ``tasks.pretrain``; a top-level module of tasks/ is its own package."""
    return ".".join(module.split(".")[:2])


def package_graph() -> dict[str, set[str]]:
    """Which package of tasks/ imports which other."""
    packages: dict[str, set[str]] = {}
    for source, targets in graph().items():
        if source.startswith("tasks."):
            packages.setdefault(package_of(source), set()).update(
                package_of(t)
                for t in targets
                if t.startswith("tasks.") and package_of(t) != package_of(source)
            )
    return packages


def floors(edges: dict[str, set[str]]) -> int:
    """How many floors the packages stand on: the longest chain of imports, counting its packages."""
    height: dict[str, int] = {}

    def of(node: str) -> int:
        if node not in height:
            height[node] = 1 + max((of(target) for target in edges[node]), default=0)
        return height[node]

    return max(of(node) for node in edges)


def test_the_job_runtime_stands_below_the_stages() -> None:
    """Pretraining and fine-tuning run their jobs on tasks/jobs/ as peers: it imports no stage."""
    packages = package_graph()
    assert RUNTIME in packages
    assert not packages[RUNTIME] - set(GROUND), (
        f"tasks/jobs/ imports {sorted(packages[RUNTIME] - set(GROUND))}"
    )
    for ground in GROUND:
        assert not packages[ground] - set(GROUND), (
            f"{ground} stands on {sorted(packages[ground] - set(GROUND))}"
        )


def test_every_package_of_tasks_has_its_floor() -> None:
    assert set(package_graph()) == {*GROUND, RUNTIME, *STAGES, "tasks.pipeline"}


def test_the_floors_inside_tasks_stay_few() -> None:
    assert floors(package_graph()) <= MAX_FLOORS


def test_floors_are_counted_along_the_longest_chain() -> None:
    # The checker itself: a → b → c and a → c stand on three floors.
    assert floors({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == 3


def private_imports() -> list[str]:
    """``from X import _name`` where X is in another package of the project than the importer."""
    found = []
    for name, path in module_files().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                origin = node.module
                if origin.split(".")[0] not in PACKAGES or package_of(origin) == package_of(name):
                    continue
                found += [f"{name} imports {origin}.{a.name}" for a in node.names if a.name.startswith("_")]
    return found


def test_no_package_imports_another_packages_private_names() -> None:
    assert private_imports() == []


def test_no_import_circles() -> None:
    assert cycles(graph()) == []


def test_a_circle_is_found() -> None:
    # The checker itself: a launcher and the module that picks launchers importing each other.
    edges = {"a.launch": {"a.slurm"}, "a.slurm": {"a.launch"}, "a.store": set()}
    assert cycles(edges) == [["a.launch", "a.slurm"]]


def test_plain_work_imports_without_prefect() -> None:
    names = sorted(name for name in module_files() if name.split(".")[0] in ("models", "tasks"))
    # Prefect made unimportable: each module still imports (its Prefect wrappers live in flows/).
    script = (
        "import importlib, sys\n"
        "sys.modules['prefect'] = None\n"
        f"for name in {names!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ImportError as error:\n"
        "        sys.exit(f'{name}: {error}')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tasks.corpus.build" in names and "tasks.pretrain.train" in names


@pytest.mark.parametrize("path", sorted((ROOT / "flows" / "cli").glob("*.py")), ids=lambda p: p.name)
def test_cli_modules_stay_small(path: Path) -> None:
    assert len(path.read_text().splitlines()) <= 300, f"{path.name}: split it by stage"


MAX_MODULE_LINES = 600  # a module above this holds more than one job: split it


def test_no_module_of_the_three_packages_is_over_600_lines() -> None:
    over = {
        str(path.relative_to(ROOT)): lines
        for path in module_files().values()
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not over, f"split by job: {over}"


# --- Stage results are typed: what a stage hands on is a pydantic model, read by attribute. -----------

# The modules at the stages' boundaries: each stage's flow module, the stages' steps, the pipeline.
BOUNDARY_MODULES = sorted(
    path
    for path in [
        *(ROOT / "flows").glob("*.py"),
        *(ROOT / "tasks").glob("*/stage.py"),
        *(ROOT / "tasks" / "pipeline").glob("*.py"),
    ]
    if "@flow(" in path.read_text() or path.name == "stage.py" or path.parent.name == "pipeline"
)
# What still passes as a dict there, and why it is no stage's result.
UNTYPED_ON_PURPOSE = {
    # The pipeline's parameters as ``--set`` edits them (a JSON document), its MLflow record, the keys' hashes.
    ("tasks/pipeline/__init__.py", "digest"),
    ("tasks/pipeline/__init__.py", "transfer_key_settings"),
    ("tasks/pipeline/__init__.py", "apply_overrides"),
    ("tasks/pipeline/__init__.py", "validated"),
    ("tasks/pipeline/record.py", "pipeline_params_of"),
    ("tasks/pipeline/record.py", "recent_pipelines"),
    ("tasks/pipeline/record.py", "shown"),  # the --json object
    ("tasks/pipeline/__init__.py", "finished_run"),  # the job runtime's latest.json
    # A scored piece's record, from one of the score stage's own tasks to its manifest.
    ("flows/score.py", "score_piece_task"),
}


def untyped_boundaries(paths: list[Path], *, listed: bool = False) -> list[str]:
    """Public functions of ``paths`` that take or return ``dict[str, Any]``, as ``path: name``: those not in
    ``UNTYPED_ON_PURPOSE``, or (``listed``) those in it."""
    found = []
    for path in paths:
        relative = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.name.startswith("_"):
                continue
            arguments = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
            annotations = [a.annotation for a in arguments if a.annotation] + (
                [node.returns] if node.returns else []
            )
            untyped = any("dict[str, Any]" in ast.unparse(a) for a in annotations)
            if untyped and ((relative, node.name) in UNTYPED_ON_PURPOSE) == listed:
                found.append(f"{relative}: {node.name}")
    return found


def test_no_stage_result_crosses_a_boundary_as_a_dict() -> None:
    """Flows, stage steps and the pipeline take and return result models: mypy sees a renamed field."""
    # The 7 flow modules, the steps of the three stages that plan a stage.py, the pipeline's bookkeeping
    # (its parameters and keys, its record).
    assert len(BOUNDARY_MODULES) == 12, BOUNDARY_MODULES
    assert untyped_boundaries(BOUNDARY_MODULES) == []
    # The list shrinks as its entries become models: one that no longer passes a dict leaves it.
    assert sorted(untyped_boundaries(BOUNDARY_MODULES, listed=True)) == sorted(
        f"{path}: {name}" for path, name in UNTYPED_ON_PURPOSE
    )


def flow_returns() -> dict[str, str]:
    """Each Prefect flow of flows/ and the name its return annotation gives."""
    found = {}
    for path in sorted((ROOT / "flows").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef) and any(
                isinstance(d, ast.Call) and ast.unparse(d.func) == "flow" for d in node.decorator_list
            ):
                found[f"{path.stem}.{node.name}"] = ast.unparse(node.returns) if node.returns else "-"
    return found


def result_models() -> set[str]:
    """The result models: the classes of each stage's ``result.py``, and the pipeline's."""
    names = {"PipelineResult"}
    for path in (ROOT / "tasks").glob("*/result.py"):
        names |= {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)}
    return names


def test_every_flow_returns_its_stages_result_model() -> None:
    returns = flow_returns()
    assert len(returns) >= 8, (
        returns
    )  # corpus, pretrain, transfer, register, finetune, score, sweep, pipeline
    assert {flow: name for flow, name in returns.items() if name not in result_models()} == {}
