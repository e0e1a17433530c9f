"""One namespace: `import widedp` (widedp.trainer, widedp.selection, widedp.accounting,
widedp.auditing, widedp.sparse_learners, widedp.adaptive_clipping), nothing generic installed at
top level, and every module — so every registry — under one name only; modules that moved are
imported from their new place only."""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OLD_NAMES = ("trainer", "selection", "accounting", "auditing", "sparse_learners", "adaptive_clipping")
#: Modules that moved (issue 28: auditing beside accounting) -> where they are now.
MOVED = {"widedp.accounting.one_run_audit": "widedp.auditing.one_run_audit",
         "widedp.accounting.canary_exposure": "widedp.auditing.canary_exposure"}
#: Names that moved out of a module that still exists: (module, name) -> where the name is now.
MOVED_NAMES = {("widedp.accounting", "Calibration"): "widedp.selection.calibration",
               ("widedp.accounting.calibration", "Calibration"): "widedp.selection.calibration",
               **{("widedp.trainer.run.audit", n): "widedp.auditing.canaries"
                  for n in ("Canaries", "CANARY_KINDS", "GRADIENT_CANARY_SCALE", "PHRASE_PLACEMENTS", "canary_features",
                            "make_canaries", "as_gradient_canaries", "make_phrase_examples")},
               **{("widedp.trainer.run.audit", n): "widedp.auditing.scores"
                  for n in ("white_box_scores", "guess_counts", "phrase_log_perplexities", "tie_broken")}}
# Every module lives in widedp/ (the top-level folders of the design card are links into it).
SOURCE_DIRS = ("widedp", "tests", "benchmarks", "examples")


def _old_style_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
        found += [f"{path.relative_to(REPO)}:{node.lineno}: {n}" for n in names if n.split(".")[0] in OLD_NAMES]
    return found


def test_no_file_imports_a_package_by_its_old_top_level_name():
    files = [p for d in SOURCE_DIRS for p in sorted((REPO / d).rglob("*.py")) if ".venv" not in p.parts]
    offending = [hit for p in files for hit in _old_style_imports(p)]
    assert not offending, "import these through widedp:\n" + "\n".join(offending)


def _moved_imports(text: str, name: str) -> list[str]:
    """Imports of a moved module, or of a moved name from the module it left, in `text`."""
    found = []
    for node in ast.walk(ast.parse(text, name)):
        if isinstance(node, ast.Import):
            found += [f"{a.name} (now {MOVED[a.name]})" for a in node.names if a.name in MOVED]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module in MOVED:
                found.append(f"{node.module} (now {MOVED[node.module]})")
            found += [f"{a.name} from {node.module} (now in {MOVED_NAMES[node.module, a.name]})" for a in node.names
                      if (node.module, a.name) in MOVED_NAMES]
            found += [f"{node.module}.{a.name} (now {MOVED[f'{node.module}.{a.name}']})" for a in node.names
                      if f"{node.module}.{a.name}" in MOVED]
    return [f"{name}:{node_hit}" for node_hit in found]


def _moved_paths(text: str) -> list[str]:
    """The old module paths in prose or code blocks: dotted, or as files."""
    old = [*MOVED, *(m.replace("widedp.", "", 1) for m in MOVED),
           *(m.replace("widedp.", "", 1).replace(".", "/") + ".py" for m in MOVED)]
    return [o for o in old if o in text]


def test_no_file_uses_a_moved_module_or_name():
    files = [p for d in SOURCE_DIRS for p in sorted((REPO / d).rglob("*.py")) if ".venv" not in p.parts]
    offending = [hit for p in files for hit in _moved_imports(p.read_text(), str(p.relative_to(REPO)))]
    here = Path(__file__).resolve()
    texts = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *(p for p in files if p.resolve() != here)]
    offending += [f"{p.relative_to(REPO)}: {o}" for p in texts for o in _moved_paths(p.read_text())]
    assert not offending, "these moved:\n" + "\n".join(offending)


def test_the_moved_check_can_fail():
    src = ("from widedp.accounting.one_run_audit import audit_from_scores\nimport widedp.accounting.canary_exposure\n"
           "from widedp.accounting import Calibration, one_run_audit\nfrom widedp.trainer.run.audit import make_canaries\n")
    hits = _moved_imports(src, "probe.py")
    assert len(hits) == 5, hits
    assert _moved_paths("see `accounting/one_run_audit.py`") == ["accounting/one_run_audit.py"]


def test_every_module_imports_under_widedp_only(tmp_path):
    """From a directory outside the repository (so the folders are not on sys.path): every module
    of the package imports, and no module is loaded under an old top-level name — a registry
    imported twice under two names would hold two sets of entries."""
    body = f"""
import importlib, pkgutil, sys
import widedp
names = [m.name for m in pkgutil.walk_packages(widedp.__path__, "widedp.")
         if ".export_template" not in m.name and not m.name.endswith(".__main__")]
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
def test_importing_a_top_level_folder_from_the_repository_root_fails_loudly(name):
    """From the repository root the design card's folders are on sys.path (they are links into
    widedp/): importing one under its folder name would load a second copy of every module and
    registry. It fails at once, naming the one name."""
    out = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0 and f"import widedp.{name}, not {name}" in out.stderr, out.stderr[-2000:]


def test_every_module_file_lives_under_widedp_and_the_top_level_folders_are_links_to_it():
    """One copy of every module, where tracebacks name it: widedp/<package>/...; the design card's
    top-level folders point there."""
    for name in OLD_NAMES:
        top, real = REPO / name, REPO / "widedp" / name
        assert top.is_symlink() and top.resolve() == real.resolve(), name
        assert real.is_dir() and not real.is_symlink(), name
    import widedp.trainer.run.train

    assert Path(widedp.trainer.run.train.__file__).resolve() == REPO / "widedp" / "trainer" / "run" / "train.py"


@pytest.mark.parametrize("name", OLD_NAMES)
def test_the_old_top_level_names_are_not_installed(name, tmp_path):
    out = subprocess.run([sys.executable, "-c", f"import importlib.util; print(importlib.util.find_spec({name!r}))"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "None", out.stdout + out.stderr


def test_the_wheel_holds_widedp_and_its_metadata_only(tmp_path):
    """The built wheel installs one top-level name, widedp, with every package and the export
    template in it."""
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path), str(REPO)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    wheel = next(tmp_path.glob("widedp-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"widedp", wheel.name.split("-py")[0] + ".dist-info"}, tops
    for module in ("widedp/trainer/cli/__init__.py", "widedp/selection/registry.py", "widedp/accounting/ledger.py",
                   "widedp/auditing/one_run_audit.py", "widedp/sparse_learners/dp_erm.py",
                   "widedp/adaptive_clipping/dp_stat.py",
                   "widedp/trainer/release/export_template/load_model.py"):
        assert module in names, module
