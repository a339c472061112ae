"""No import runs back up the layers: the ``gateway`` package's import graph has no cycle.

Every module is parsed with :mod:`ast`, nothing is imported, and *every* import counts: at
the top of a file, inside a function, and under ``if TYPE_CHECKING:``. A reader has to hold
all of them, so a circle closed by an import inside a function is still a circle.

``from a import b`` is an edge to ``a.b`` when that is a module of the package, else to
``a``. The implicit import of a module's parent packages is not an edge (else every
package whose ``__init__`` imports its children would be a circle). To see the graph as the
test sees it::

    .venv/bin/python -m tests.unit.test_import_cycles
"""

from __future__ import annotations

from .imports import graph


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan), each
    given as a closed path through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return [closed_path(edges, component) for component in components]


def closed_path(edges: dict[str, set[str]], component: set[str]) -> list[str]:
    """The shortest path from the component's first module back to itself."""
    start = min(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for target in sorted(edges[node] & component):
            if target == start:
                return [*paths[node], start]
            if target not in paths:
                paths[target] = [*paths[node], target]
                queue.append(target)
    raise AssertionError("a strongly connected component without a cycle")


def test_the_graph_is_read_whole() -> None:
    edges = graph()
    # an import inside a function and one under TYPE_CHECKING are both read
    assert "gateway.embedded" in edges["gateway.cli"]
    assert "gateway.runtime" in edges["gateway.scrape"]
    assert "gateway.protocol" in edges["gateway.sdk.client.connection"]


def test_the_cycle_finder_finds_a_cycle() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle() -> None:
    found = cycles(graph())
    assert not found, "import cycles in the gateway package:\n" + "\n".join(
        " -> ".join(cycle) for cycle in found)


if __name__ == "__main__":
    for module, targets in sorted(graph().items()):
        print(module, "->", ", ".join(sorted(targets)))
