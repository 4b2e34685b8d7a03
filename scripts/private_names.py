"""Fail if a module of ``src/retrysafe`` imports a private name from outside its subpackage.

The rule (docs/architecture.md): shared code lives in the layer below under a real
name. A private name (``_x``) may be imported only by a module of the same
subpackage (``retrysafe._core.*`` from ``retrysafe._core.*``, ``retrysafe.stores.*``
from ``retrysafe.stores.*``); top-level modules share no private names at all.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "src"


def module_of(path: Path) -> list[str]:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def package_of(parts: list[str], is_init: bool) -> list[str]:
    return parts if is_init else parts[:-1]


def violations() -> list[str]:
    found = []
    for path in sorted((ROOT / "retrysafe").rglob("*.py")):
        parts = module_of(path)
        package = package_of(parts, path.name == "__init__.py")
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = base + (node.module.split(".") if node.module else [])
            else:
                target = (node.module or "").split(".")
            if target[:1] != ["retrysafe"]:
                continue
            for alias in node.names:
                name = alias.name
                if not name.startswith("_") or name.startswith("__"):
                    continue
                whole = [*target, name]
                # importing a private *module* of a package (retrysafe._core) is the layering
                if whole[:-1] == ["retrysafe"] and (ROOT / "retrysafe" / name).is_dir():
                    continue
                if (ROOT.joinpath(*whole)).is_dir() or (
                    ROOT.joinpath(*whole[:-1], name + ".py")
                ).exists():
                    owner = whole[:-1]
                else:
                    owner = target[:-1] if len(target) > 1 else target
                if owner == package and len(package) > 1:
                    continue
                where = f"{path.relative_to(ROOT.parent)}:{node.lineno}"
                found.append(f"{where}: imports {name} from {'.'.join(target)}")
    return found


def main() -> int:
    found = violations()
    for line in found:
        print(line)
    if found:
        print(f"{len(found)} private name(s) imported across subpackages", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
