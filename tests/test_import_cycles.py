"""No two of dapple's modules import each other, directly or through others, counting imports
inside functions too (a cycle hidden in a function is still a cycle).

Every module of every library package and subpackage is a node, a package's `__init__.py`
too (named as the package: `import dapple` runs it). `from P import N` imports module `P.N`
when there is one, else `P` itself (N is a name P's `__init__` defines)."""
import ast
import os

from tests.paths import REPO

PACKAGES = ("topology", "planner", "reports", "graph_rewrite", "dapple")


def library_modules():
    """{dotted name: path} of every module of PACKAGES; a package's `__init__.py` by its name."""
    modules = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(REPO, package)):
            prefix = os.path.relpath(folder, REPO).replace(os.sep, ".")
            for f in files:
                if f.endswith(".py"):
                    modules[prefix if f == "__init__.py" else f"{prefix}.{f[:-3]}"] = \
                        os.path.join(folder, f)
    return modules


def imports_of(path, modules):
    """The modules of dapple's packages a file imports, anywhere in it."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules
                       else node.module for a in node.names)
    return {n for n in out if n.split(".")[0] in PACKAGES}


def module_graph():
    modules = library_modules()
    return {m: sorted(imports_of(p, modules) & set(modules) - {m}) for m, p in modules.items()}


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


def test_every_package_and_every_import_is_in_the_graph():
    modules = library_modules()
    for name in ("dapple", "dapple.runtime", "dapple.runtime.horovod.transport",
                 "dapple.runtime.tf_cluster", "dapple.commands.plan", "reports.timeline",
                 "planner.schedules", "planner.estimate.simulator", "topology",
                 "graph_rewrite.pipeline"):
        assert name in modules, name
    unknown = {n for p in modules.values() for n in imports_of(p, modules)} - set(modules)
    assert not unknown, sorted(unknown)        # a module the walk missed would hide its edges


def test_modules_import_no_cycle():
    cycle = find_cycle(module_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": ["b"], "b": [], "c": ["a", "b"]}) is None
