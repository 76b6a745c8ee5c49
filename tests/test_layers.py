"""The import graph of the kernel package, the overlay and the benchmarks: every import (module level or inside a
function) points down the layers or sideways within one, and no group of modules imports itself in a loop.

    sgl_kernel_sm120:     _abi, errors, settings  <  _ext, reference, watchdog, exchange  <  policy (which
                          reads the kernel limits from _ext's library on first use)  <  cluster_check  <  construction
                          <  data_path_probe  <  ipc_allreduce  <  __init__; imports nothing of the overlay; _abi,
                          errors, settings, watchdog, exchange, policy and cluster_check import torch in functions
                          only (the overlay's pure parts, the routing table and the offline report among them,
                          import them without torch)
    python/sglang_sm120:  core  <  routing  <  tuning, reporting  <  runtime  <  hooks  <  seams
                          <  plugin, launch_server, doctor, tune, report, __init__
                          testing imports nothing of the overlay (tests and benchmarks only)
    benchmarks:           harness  <  workloads  <  peers  <  bench_*.py, cpu_smoke.py
"""

from __future__ import annotations

import ast
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

KERNEL_LAYERS = {"_abi": 0, "errors": 0, "settings": 0, "_ext": 1, "reference": 1, "watchdog": 1,
                 "exchange": 1, "policy": 2, "cluster_check": 3, "construction": 4, "data_path_probe": 5,
                 "ipc_allreduce": 6, "": 7}
# no torch when imported
KERNEL_PURE = ("_abi", "errors", "settings", "watchdog", "exchange", "policy", "cluster_check")
OVERLAY_LAYERS = {"core": 0, "routing": 1, "tuning": 2, "runtime": 3, "hooks": 4, "seams": 5, "": 6}
BENCH_LAYERS = {"harness": 0, "workloads": 1, "peers": 2, "": 3}


def _modules(root: str, package: str) -> dict[str, str]:
    """Dotted module name -> file, for every .py under root (a package named `package`)."""
    found = {}
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, name), root)[: -len(".py")].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                found[".".join([package, *rel])] = os.path.join(folder, name)
    return found


def _imports(module: str, path: str, is_package: bool, modules: dict[str, str]) -> set[str]:
    """Every module `module` imports, as absolute dotted names (relative imports resolved). `from pkg import mod`
    counts as importing mod, not pkg's __init__ (which Python runs anyway as the parent of mod)."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    here = module.split(".") if is_package else module.split(".")[:-1]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = (here[: len(here) - node.level + 1] if node.level else []) + (node.module or "").split(".")
            base = ".".join(part for part in base if part)
            children = {f"{base}.{alias.name}" for alias in node.names}
            out.update(children & set(modules) or {base})
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module" and node.args:
            if isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                out.add(node.args[0].value)
    return out


def _graph(root: str, package: str) -> dict[str, set[str]]:
    modules = _modules(root, package)
    graph = {}
    for module, path in modules.items():
        targets = _imports(module, path, path.endswith("__init__.py"), modules)
        graph[module] = {t for t in targets if t in modules and t != module}
    return graph


def _layer(module: str, package: str, layers: dict[str, int]) -> tuple[str, int]:
    parts = module.split(".")
    folder = parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in layers) else ""
    return folder, layers.get(folder, layers[""])


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


CASES = {
    "kernels": (os.path.join(REPO, "sgl_kernel_sm120"), "sgl_kernel_sm120", KERNEL_LAYERS),
    "overlay": (os.path.join(REPO, "python", "sglang_sm120"), "sglang_sm120", OVERLAY_LAYERS),
    "benchmarks": (os.path.join(REPO, "benchmarks"), "benchmarks", BENCH_LAYERS),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_no_import_runs_up_a_layer(case):
    root, package, layers = CASES[case]
    graph = _graph(root, package)
    upward = []
    for src, targets in graph.items():
        src_folder, src_layer = _layer(src, package, layers)
        for dst in targets:
            dst_folder, dst_layer = _layer(dst, package, layers)
            if src_folder == "testing" or dst_folder == "testing":
                if src_folder != dst_folder and src_folder == "testing":
                    upward.append(f"{src} -> {dst} (testing/ imports nothing of the package)")
                continue
            if dst_layer > src_layer:
                upward.append(f"{src} -> {dst}")
    assert not upward, upward


@pytest.mark.parametrize("case", sorted(CASES))
def test_no_import_circle(case):
    root, package, _ = CASES[case]
    cycle = _cycle(_graph(root, package))
    assert cycle is None, " -> ".join(cycle)


def test_every_kernel_module_has_a_layer():
    modules = _modules(os.path.join(REPO, "sgl_kernel_sm120"), "sgl_kernel_sm120")
    assert {name.split(".", 1)[1] if "." in name else "" for name in modules} == set(KERNEL_LAYERS)


def _module_level_imports(path: str) -> set[str]:
    """What a module imports when it is imported (its top level, not inside its functions or classes)."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    out = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out.add(node.module or "")
    return out


def test_the_kernel_package_knows_nothing_of_the_overlay_and_its_pure_layers_need_no_torch():
    root = os.path.join(REPO, "sgl_kernel_sm120")
    modules = _modules(root, "sgl_kernel_sm120")
    found = []
    for module, path in modules.items():
        everything = _imports(module, path, path.endswith("__init__.py"), modules)
        found += [f"{module} -> {t}" for t in everything if t.split(".")[0] in ("sglang_sm120", "benchmarks")]
        if module.split(".")[-1] in KERNEL_PURE:
            found += [f"{module} imports {t} when imported" for t in _module_level_imports(path)
                      if t.split(".")[0] == "torch"]
    assert not found, found
