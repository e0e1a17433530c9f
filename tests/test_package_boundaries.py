"""The design's boundaries between the namespace's packages (issue 28, "Structure").

- trainer/ is the only place that knows Ray (and the run loop): selection/, accounting/,
  auditing/, sparse_learners/ and adaptive_clipping/ import neither Ray nor widedp.trainer.
- accounting/ says what is claimed and imports no other widedp package (calibration takes an
  event builder instead of knowing selectors: tests/test_calibration_builder.py).
- auditing/ measures it: the standard library, numpy, scipy and widedp.accounting only — no
  torch/torchrec, no Ray, nothing else of widedp (auditing/__init__.py states the rule); the
  glue that trains with canaries is trainer/run/audit.py.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PURE = ("selection", "accounting", "auditing", "sparse_learners", "adaptive_clipping")
AUDITING_ALLOWED = {"numpy", "scipy", "widedp.accounting", "widedp.auditing"}


def _imports(text: str, package: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `text` (function bodies included);
    relative imports resolved from `package`."""
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out.append((node.lineno, base))
    return out


def _package_of(path: Path) -> str:
    return ".".join(path.relative_to(REPO).parent.parts)  # widedp/<package>/...


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _auditing_violations(text: str, package: str = "widedp.auditing") -> list[str]:
    bad = []
    for line, name in _imports(text, package):
        root = name.split(".")[0]
        if name == "__future__" or (root in sys.stdlib_module_names and root != "widedp"):
            continue
        if not any(_within(name, ok) for ok in AUDITING_ALLOWED):
            bad.append(f"{line}: {name}")
    return bad


def test_auditing_imports_only_the_standard_library_numpy_scipy_and_accounting():
    files = sorted((REPO / "widedp" / "auditing").rglob("*.py"))
    assert len(files) >= 5
    offending = [f"{p.relative_to(REPO)}:{hit}" for p in files for hit in _auditing_violations(p.read_text(), _package_of(p))]
    assert not offending, "auditing may import the standard library, numpy, scipy and widedp.accounting only:\n" + \
        "\n".join(offending)


def test_the_auditing_rule_can_fail():
    assert _auditing_violations("import torch\nfrom ray import util\n") == ["1: torch", "2: ray"]
    assert _auditing_violations("def f():\n    from widedp.trainer.run.train import build_run\n") == [
        "2: widedp.trainer.run.train"]
    assert _auditing_violations("from ..selection import registry\n") == ["1: widedp.selection"]
    assert not _auditing_violations("import math\nimport numpy as np\nfrom scipy import stats\n"
                                    "from widedp.accounting import events\nfrom . import scores\n")


@pytest.mark.parametrize("package", PURE)
def test_pure_libraries_import_neither_ray_nor_the_trainer(package):
    offending = []
    for path in sorted((REPO / "widedp" / package).rglob("*.py")):
        for line, name in _imports(path.read_text(), _package_of(path)):
            if _within(name, "ray") or _within(name, "widedp.trainer"):
                offending.append(f"{path.relative_to(REPO)}:{line}: {name}")
    assert not offending, "only trainer/ knows Ray and the run loop:\n" + "\n".join(offending)


def test_accounting_imports_no_other_widedp_package():
    offending = []
    for path in sorted((REPO / "widedp" / "accounting").rglob("*.py")):
        for line, name in _imports(path.read_text(), _package_of(path)):
            if _within(name, "widedp") and not _within(name, "widedp.accounting"):
                offending.append(f"{path.relative_to(REPO)}:{line}: {name}")
    assert not offending, "\n".join(offending)


def test_importing_auditing_loads_no_torch_ray_or_trainer(tmp_path):
    body = ("import importlib, pkgutil, sys\nimport widedp.auditing as a\n"
            "for m in pkgutil.walk_packages(a.__path__, 'widedp.auditing.'):\n    importlib.import_module(m.name)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torchrec', 'ray')\n"
            "             or m.startswith(('widedp.trainer', 'widedp.selection'))))\n")
    out = subprocess.run([sys.executable, "-c", body], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


# ---- the trainer's folders (issue 48): each opening docstring says what it may import --------------

import re  # noqa: E402

TRAINER = REPO / "widedp" / "trainer"
#: Every folder of the trainer, by concern (README, "Layout").
TRAINER_PACKAGES = ("cli", "config", "engine", "cluster", "private", "run", "release", "models", "data",
                    "data.format", "data.convert", "data.synthetic")


def _allowed(package: str) -> set[str]:
    """The trainer modules a package's opening docstring allows, from its "May import:" paragraph."""
    doc = ast.get_docstring(ast.parse((TRAINER / package.replace(".", "/") / "__init__.py").read_text())) or ""
    match = re.search(r"May import:(.*?)(?:\n\s*\n|\nNot:|$)", doc, re.S)
    assert match, f"trainer/{package}/__init__.py: its docstring must say what it may import (a 'May import:' line)"
    return set(re.findall(r"widedp\.trainer\.[\w.]*\w", match.group(1)))


def _trainer_violations(package: str) -> list[str]:
    own = f"widedp.trainer.{package}"
    allowed = _allowed(package)
    sub = {f"widedp.trainer.{p}" for p in TRAINER_PACKAGES if p.startswith(package + ".")}
    bad = []
    for path in sorted((TRAINER / package.replace(".", "/")).rglob("*.py")):
        if "export_template" in path.parts or any(_within(_package_of(path), s) for s in sub):
            continue  # a sub-package has rules of its own
        for line, name in _imports(path.read_text(), _package_of(path)):
            if not _within(name, "widedp.trainer") or name == "widedp.trainer" or _within(name, own):
                continue
            if not any(_within(name, a) for a in allowed):
                bad.append(f"{path.relative_to(REPO)}:{line}: {name}")
    return bad


@pytest.mark.parametrize("package", TRAINER_PACKAGES)
def test_each_trainer_folder_imports_only_what_its_docstring_allows(package):
    bad = _trainer_violations(package)
    assert not bad, f"trainer/{package}: imports its docstring does not allow:\n" + "\n".join(bad)


def test_every_trainer_folder_is_listed_and_the_docstring_rule_can_fail(tmp_path):
    folders = {str(p.parent.relative_to(TRAINER)).replace("/", ".") for p in TRAINER.rglob("__init__.py")}
    folders -= {"."}
    assert folders == set(TRAINER_PACKAGES), folders ^ set(TRAINER_PACKAGES)
    assert "widedp.trainer.cluster" not in _allowed("engine")  # the engine never imports the cluster
    assert _allowed("data") == set()  # the data layer imports nothing of the trainer outside data/
