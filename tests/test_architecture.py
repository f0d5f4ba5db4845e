"""The architecture's rules, checked on the source: declared seams, not probing; one direction of imports;
a decode path that reads in small functions."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from mirrorsd import contracts

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mirrorsd", "runtime", "apps", "devices", "exporters")


def sources(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def protocol_members() -> set[str]:
    """Every attribute and method the contracts' Protocols declare."""
    names: set[str] = set()
    for _, cls in inspect.getmembers(contracts, inspect.isclass):
        if getattr(cls, "_is_protocol", False) and cls.__module__ == contracts.__name__:
            for klass in cls.__mro__:
                if klass.__module__ == contracts.__name__:
                    names |= set(getattr(klass, "__annotations__", {}))
                    names |= {n for n, v in vars(klass).items() if callable(v) and not n.startswith("_")}
    return names


def test_the_protocols_declare_what_the_loops_use():
    members = protocol_members()
    assert {"score", "truncate", "reset", "close", "vocab_size", "max_context", "computes_on", "backend",
            "early_exit", "threads", "propose", "propose_iter", "accepted", "finish", "lm", "num_layers",
            "score_with_exit", "set_threads", "between_layers", "model", "learner", "ranking",
            "propose_ranked"} <= members


def probed_protocols() -> set[str]:
    """The contracts' Protocols that nothing may test with isinstance: abilities are declared attributes."""
    return {name for name, cls in inspect.getmembers(contracts, inspect.isclass)
            if getattr(cls, "_is_protocol", False) and cls.__module__ == contracts.__name__} - {"CausalLM"}


@pytest.mark.parametrize("path", sources(*PACKAGES), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_isinstance_probing_of_drafters_or_capabilities(path):
    protocols = probed_protocols()
    assert {"Drafter", "DraftModel", "Ranking", "Learner"} <= protocols
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
            names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
            assert not names & protocols, \
                f"{path.name}:{node.lineno} probes {names & protocols}: read the declared attribute instead"


@pytest.mark.parametrize("path", sources(*PACKAGES), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_hasattr_or_getattr_probing_for_protocol_members(path):
    members = protocol_members()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr") \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
            assert node.args[1].value not in members, \
                f"{path.name}:{node.lineno} probes {node.args[1].value!r}: declare it in a Protocol instead"


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found


@pytest.mark.parametrize("path", sources("runtime"), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_runtime_does_not_import_the_exporters_or_the_apps(path):
    bad = {m for m in imports(path) if m.startswith(("mirrorsd.exporters", "mirrorsd.apps"))}
    assert not bad, f"{path.name} imports {bad}: shared formats live in mirrorsd/ (export_format, tokenizer_check)"


SDK_MODULES = {f"mirrorsd.{p.stem}" for p in (ROOT / "mirrorsd").glob("*.py") if not p.stem.startswith("_")}
SDK = {"mirrorsd", "mirrorsd.devices", "mirrorsd.exporters"} | SDK_MODULES


@pytest.mark.parametrize("path", sources("apps"), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_apps_use_only_the_sdk(path):
    """The apps see what any SDK user sees: the mirrorsd package's modules (drafters, backends and bench are
    the facades for what the apps need beyond Engine), and the devices and exporters packages' top level."""
    assert {"mirrorsd.drafters", "mirrorsd.backends", "mirrorsd.bench", "mirrorsd.engine"} <= SDK_MODULES
    ours = {m for m in imports(path) if m == "mirrorsd" or m.startswith("mirrorsd.")}
    bad = {m for m in ours if m not in SDK and not m.startswith("mirrorsd.apps")}
    assert not bad, f"{path.name} imports {bad}: reach them through the SDK's public modules"


# The modules that compute on the target's logits: torch.Tensor is CausalLM.score's return type.
LOGIT_MATH = {"verify.py", "sampling.py", "grammar.py"}


@pytest.mark.parametrize("path", sources("runtime/decode"), ids=lambda p: p.name)
def test_the_decode_loops_know_backends_and_drafters_only_by_their_protocols(path):
    banned = ("mirrorsd.runtime.backends", "mirrorsd.runtime.drafters") + (() if path.name in LOGIT_MATH else ("torch",))
    bad = {m for m in imports(path) if m.startswith(banned)}
    assert not bad, f"{path.name} imports {bad}"


MODULE_ROOTS = {"mirrorsd": "mirrorsd", "runtime": "mirrorsd.runtime", "apps": "mirrorsd.apps",
                "devices": "mirrorsd.devices", "exporters": "mirrorsd.exporters"}


def module_graph() -> dict[str, set[str]]:
    """Each of our modules -> the modules of ours it imports, at module level or inside a function alike (an
    import inside a function hides a cycle from Python, not from a reader)."""
    paths = {}
    for folder, package in MODULE_ROOTS.items():
        for path in sources(folder):
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            paths[".".join([package, *parts])] = path
    graph = {}
    for name, path in paths.items():
        found = set()
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
                for alias in node.names:
                    found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in paths else base)
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
        graph[name] = (found & set(paths)) - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root), on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt), on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
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


def test_no_import_cycles():
    graph = module_graph()
    assert "mirrorsd.runtime.decode.loop" in graph and "mirrorsd.apps.serve.openai_api" in graph
    assert cycles(graph) == []
    # the check finds one where there is one
    assert cycles({**graph, "mirrorsd.runtime.decode.plan": graph["mirrorsd.runtime.decode.plan"] | {
        "mirrorsd.engine"}}) != []


DECODE_PATH = [*sources("runtime/decode"), ROOT / "mirrorsd" / "engine.py", ROOT / "mirrorsd" / "text_stream.py"]


def code_lines(node: ast.FunctionDef) -> int:
    """A function's lines without its docstring."""
    first = node.body[0]
    doc = first.end_lineno - first.lineno + 1 if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                                                  and isinstance(first.value.value, str)) else 0
    return node.end_lineno - node.lineno + 1 - doc


@pytest.mark.parametrize("path", DECODE_PATH, ids=lambda p: p.name)
def test_no_function_in_the_decode_path_is_over_forty_lines(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert code_lines(node) <= 40, f"{path.name}:{node.name} is {code_lines(node)} lines"


@pytest.mark.parametrize("facade", ["mirrorsd.drafters", "mirrorsd.backends", "mirrorsd.bench", "mirrorsd"])
def test_the_sdk_modules_serve_every_name_they_list(facade):
    import importlib

    module = importlib.import_module(facade)
    for name in module.__all__:
        assert getattr(module, name) is not None, f"{facade}.{name}"


def calls_in(path: Path, qualname: str) -> set[str]:
    """The names a function calls (`f(...)` -> "f", `x.f(...)` -> "x.f"), the function given as "Class.method"
    or "function"."""
    tree = ast.parse(path.read_text())
    *owner, name = qualname.split(".")
    scope = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == owner[0]).body if owner else tree.body
    fn = next(n for n in scope if isinstance(n, ast.FunctionDef) and n.name == name)
    return {ast.unparse(n.func) for n in ast.walk(fn) if isinstance(n, ast.Call)}


def test_the_accept_rule_is_four_calls_from_generate_across_three_files():
    """Engine.generate -> Engine._run -> run_plan -> DecodeState.verify -> verify, as docs/ARCHITECTURE.md says."""
    engine, loop, verify = ROOT / "mirrorsd/engine.py", ROOT / "runtime/decode/loop.py", ROOT / "runtime/decode/verify.py"
    assert "self._run" in calls_in(engine, "Engine.generate")
    assert "run_plan" in calls_in(engine, "Engine._run")
    assert "state.verify" in calls_in(loop, "run_plan")
    assert "verify" in calls_in(verify, "DecodeState.verify")
    assert "Engine.generate` ->\n`Engine._run`" in (ROOT / "docs/ARCHITECTURE.md").read_text()


def architecture_folders() -> set[str]:
    """The folders docs/ARCHITECTURE.md's tree table names (its first column)."""
    text = (ROOT / "docs/ARCHITECTURE.md").read_text()
    table = text[text.index("<!-- folders"):text.index("\n\n", text.index("| folder |"))]
    return {line.split("`")[1].rstrip("/") for line in table.splitlines() if line.startswith("| `")}


def test_the_architecture_map_names_every_source_folder():
    source = {str(p.parent.relative_to(ROOT)) for folder in (*PACKAGES, "scripts", "tests")
              for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts}
    source -= {f for f in source if f.startswith("tests/")}  # tests/ mirrors the tree: one row
    assert architecture_folders() == source, "docs/ARCHITECTURE.md's folder table and the tree differ"


def test_the_tests_mirror_the_source_tree():
    """Every folder of tests stands for a source folder (tests/sdk/ for mirrorsd/, the SDK): a module's tests are
    found where the module is."""
    folders = {p.parent.relative_to(ROOT / "tests") for p in (ROOT / "tests").rglob("test_*.py")} - {Path(".")}
    assert Path("runtime/decode/policy") in folders and Path("apps/serve") in folders
    for folder in folders:
        source = ROOT / ("mirrorsd" if folder == Path("sdk") else folder)
        assert source.is_dir() and any(source.glob("*.py")), f"tests/{folder} mirrors no source folder"
