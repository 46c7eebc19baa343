"""No import cycle anywhere in the project, imports inside functions and those made only for type
checking (``if TYPE_CHECKING:``) included: a loop hidden from the interpreter is still a loop in the design.

import-linter's contracts (``.importlinter``, run by ``make lint``) keep the rooms in order and
the modules of each package free of loops; this walks every first-party module of every top
package together, so a loop across packages (an agent module and a runtime one, say), or one
held apart by an import inside a function, fails here too.
"""

from __future__ import annotations

import sys

import grimp
import networkx as nx

from tests.paths import REPO

PACKAGES = ("inference", "agent", "controlplane", "benchmarks", "deploy")


def test_no_module_imports_itself_through_others() -> None:
    for path in (str(REPO), str(REPO / "platform")):
        if path not in sys.path:
            sys.path.insert(0, path)
    graph = grimp.build_graph(*PACKAGES, include_external_packages=False, exclude_type_checking_imports=False)
    assert len(graph.modules) > 200, "the walk should see the whole project"
    imports = nx.DiGraph(
        (module, imported) for module in graph.modules for imported in graph.find_modules_directly_imported_by(module)
    )
    cycle = next(iter(nx.simple_cycles(imports)), None)
    assert cycle is None, " -> ".join([*cycle, cycle[0]])
