"""No two of dapple's modules import each other, directly or through others, counting imports
inside functions too (a cycle hidden in a function is still a cycle)."""
import ast
import os

from tests.paths import REPO

PACKAGES = ("topology", "planner", "reports", "graph_rewrite", "dapple")


def imports_of(path):
    """The modules of dapple's packages a file imports, anywhere in it."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        out.update(n for n in names if n.split(".")[0] in PACKAGES)
    return out


def module_graph():
    modules = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(REPO, package)):
            prefix = os.path.relpath(folder, REPO).replace(os.sep, ".")
            for f in files:
                if f.endswith(".py") and f != "__init__.py":
                    modules[f"{prefix}.{f[:-3]}"] = os.path.join(folder, f)
    return {m: sorted(imports_of(p) & set(modules) - {m}) for m, p in modules.items()}


def find_cycle(graph):
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in graph[m]:
            if state.get(n) == "open":
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        state[m] = "done"
        stack.pop()
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_modules_import_no_cycle():
    cycle = find_cycle(module_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": ["b"], "b": [], "c": ["a", "b"]}) is None
