"""One namespace: `import widedp` (widedp.trainer, widedp.selection, widedp.accounting,
widedp.sparse_learners, widedp.adaptive_clipping), nothing generic installed at top level, and
every module — so every registry — under one name only."""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OLD_NAMES = ("trainer", "selection", "accounting", "sparse_learners", "adaptive_clipping")


def _old_style_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
        found += [f"{path.relative_to(REPO)}:{node.lineno}: {n}" for n in names if n.split(".")[0] in OLD_NAMES]
    return found


def test_no_file_imports_a_package_by_its_old_top_level_name():
    files = [p for d in ("trainer", "selection", "accounting", "sparse_learners", "adaptive_clipping", "tests",
                         "benchmarks", "widedp") for p in sorted((REPO / d).rglob("*.py")) if ".venv" not in p.parts]
    offending = [hit for p in files for hit in _old_style_imports(p)]
    assert not offending, "import these through widedp:\n" + "\n".join(offending)


def test_every_module_imports_under_widedp_only(tmp_path):
    """From a directory outside the repository (so the folders are not on sys.path): every module
    of the package imports, and no module is loaded under an old top-level name — a registry
    imported twice under two names would hold two sets of entries."""
    body = f"""
import importlib, pkgutil, sys
import widedp
names = [m.name for m in pkgutil.walk_packages(widedp.__path__, "widedp.")
         if ".export_template" not in m.name]
for name in names:
    importlib.import_module(name)
old = sorted(m for m in sys.modules if m.split(".")[0] in {OLD_NAMES!r})
assert not old, old
from widedp.selection.registry import selector_names
print(len(names), len(selector_names()))
"""
    out = subprocess.run([sys.executable, "-c", body], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    modules, selectors = map(int, out.stdout.split())
    assert modules > 80 and selectors >= 8


@pytest.mark.parametrize("name", OLD_NAMES)
def test_the_old_top_level_names_are_not_installed(name, tmp_path):
    out = subprocess.run([sys.executable, "-c", f"import importlib.util; print(importlib.util.find_spec({name!r}))"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "None", out.stdout + out.stderr


def test_the_wheel_holds_widedp_and_its_metadata_only(tmp_path):
    """The built wheel (links followed) installs one top-level name, widedp, with every package
    and the export template in it."""
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path), str(REPO)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    wheel = next(tmp_path.glob("widedp-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"widedp", wheel.name.split("-py")[0] + ".dist-info"}, tops
    for module in ("widedp/trainer/cli.py", "widedp/selection/registry.py", "widedp/accounting/ledger.py",
                   "widedp/sparse_learners/dp_erm.py", "widedp/adaptive_clipping/dp_stat.py",
                   "widedp/trainer/export_template/load_model.py"):
        assert module in names, module
