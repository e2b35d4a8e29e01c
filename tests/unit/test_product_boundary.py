"""The product does not ship its measuring rig: no module of the installed packages imports the benchmarks (``bench``),
the rig the tests and benchmarks share (``rig``) or the tests, and neither is installed with the product."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("controlplane", "sluice", "enginesim", "ratelimit")
RIG = ("bench", "rig", "tests")


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_no_product_module_imports_the_rig() -> None:
    files = [f for package in PRODUCT for f in (ROOT / package).rglob("*.py")]
    assert len(files) > 50
    found = sorted(f"{f.relative_to(ROOT)}: {name}" for f in files for name in _imports(f)
                   if name.split(".")[0] in RIG)
    assert found == []


def test_the_rig_is_not_installed_and_plotting_is_not_a_runtime_dependency() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    included = project["tool"]["setuptools"]["packages"]["find"]["include"]
    assert sorted(p.rstrip("*") for p in included) == sorted(PRODUCT)
    runtime = " ".join(project["project"]["dependencies"])
    assert "matplotlib" not in runtime and "grpcio-tools" not in runtime
    assert any("matplotlib" in d for d in project["project"]["optional-dependencies"]["bench"])
    assert (ROOT / "bench" / "__main__.py").is_file() and (ROOT / "rig" / "__init__.py").is_file()
