"""An import-linter contract type for a part of an external package: `torch.distributed`.

import-linter sees an external package as one node (`torch`), so its `forbidden` contract
cannot say "anything of torch but torch.distributed" (it refuses `torch.distributed` as a
forbidden module). This contract reads the source of every module that imports the
external package and finds where it reaches the named part: `import torch.distributed`,
`from torch.distributed.x import y`, `from torch import distributed`, or an attribute
chain `torch.distributed...` after a plain `import torch`.

    [tool.importlinter]
    contract_types = ["forbidden_external_part: tools.import_contracts.ForbiddenExternalPart"]

    [[tool.importlinter.contracts]]
    type = "forbidden_external_part"
    source_modules = ["disttrain"]                 # and everything under them
    forbidden_modules = ["torch.distributed"]      # dotted parts of external packages
    allowed_modules = ["disttrain.strategies.ddp"]  # and everything under them

Only direct uses count (a module that imports one of the allowed modules is not
reaching `torch.distributed` itself). An allowed module that no longer uses a forbidden
part breaks the contract too, so the list of allowed modules stays exact.

`lint-imports` puts its working directory on `sys.path`, so run it from the repository
root (`make lint` does).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from grimp import ImportGraph
from importlinter.application import output
from importlinter.domain import fields
from importlinter.domain.contract import Contract, ContractCheck


def _dotted(node: ast.expr) -> str | None:
    """`a.b.c` for an attribute chain on a plain name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def _within(name: str, part: str) -> bool:
    return name == part or name.startswith(part + ".")


def uses_of(source: str, part: str) -> list[tuple[int, str]]:
    """Where `source` reaches the external module `part` (for example `torch.distributed`).

    Args:
        source: the text of one Python module.
        part: a dotted module name below an external package's root.

    Returns:
        (line number, the line's text) of each import or attribute chain naming `part` or
        something inside it, in line order, once per line.
    """
    found: dict[int, str] = {}
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source)):
        named: list[str] = []
        if isinstance(node, ast.Import):
            named = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            named = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            named = [dotted] if dotted else []
        if any(_within(name, part) for name in named):
            found.setdefault(node.lineno, lines[node.lineno - 1].strip())
    return sorted(found.items())


def module_file(module: str) -> Path:
    """The source file of an internal module, found from its root package's location (the
    one grimp analysed: the first on `sys.path`)."""
    root, *rest = module.split(".")
    spec = importlib.util.find_spec(root)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"cannot find the package {root!r} on sys.path")
    path = Path(list(spec.submodule_search_locations)[0]).joinpath(*rest)
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


class ForbiddenExternalPart(Contract):
    """The source modules (and their descendants) may not use the forbidden parts of external
    packages, except the allowed modules (and their descendants).

    Configuration options:
        - source_modules: the modules checked, each with everything under it.
        - forbidden_modules: dotted names inside external packages (`torch.distributed`).
        - allowed_modules: the modules that may use them, each with everything under it;
          each must use one of them, or the contract is broken.
    """

    type_name = "forbidden_external_part"

    source_modules = fields.ListField(subfield=fields.StringField())
    forbidden_modules = fields.ListField(subfield=fields.StringField())
    allowed_modules = fields.ListField(subfield=fields.StringField(), required=False, default=[])

    def check(self, graph: ImportGraph, verbose: bool) -> ContractCheck:
        sources, parts = list(self.source_modules), list(self.forbidden_modules)
        allowed = list(self.allowed_modules)
        for name in [*sources, *allowed]:
            if name not in graph.modules:
                raise ValueError(f"{self.name}: module {name!r} does not exist")
        roots = {part.split(".")[0] for part in parts}
        checked = set()
        for source in sources:
            checked |= {source, *graph.find_descendants(source)}

        violations, allowed_uses = [], {name: 0 for name in allowed}
        for module in sorted(checked):
            if not roots & graph.find_modules_directly_imported_by(module):
                continue
            text = module_file(module).read_text()
            uses = [(part, line, code) for part in parts for line, code in uses_of(text, part)]
            if not uses:
                continue
            owner = next((name for name in allowed if _within(module, name)), None)
            if owner is not None:
                allowed_uses[owner] += 1
            else:
                violations.append({"module": module, "uses": uses})
        unused = [name for name, count in allowed_uses.items() if count == 0]
        return ContractCheck(kept=not violations and not unused,
                             metadata={"violations": violations, "unused_allowed": unused})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for violation in check.metadata["violations"]:
            output.print_error(f"{violation['module']} is not allowed to use "
                               f"{', '.join(sorted({part for part, _, _ in violation['uses']}))}:")
            for _, line, code in violation["uses"]:
                output.print_error(f"-   line {line}: {code}", bold=False)
            output.new_line()
        parts = ", ".join(self.forbidden_modules)
        for name in check.metadata["unused_allowed"]:
            output.print_error(f"{name} is allowed to use {parts} but does not: "
                               "remove it from allowed_modules", bold=False)
            output.new_line()
