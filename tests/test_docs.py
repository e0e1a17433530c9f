"""The documents (issue 48): a README a newcomer reads in minutes, a site built from docs/ whose
references are generated from the code (`make test` builds it with `mkdocs build --strict`,
which fails on a broken link or a page left out), and links that resolve."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "docs"))

import hooks  # noqa: E402  (docs/hooks.py: the generated reference pages)


def _nav_pages(nav) -> list[str]:
    out = []
    for item in nav:
        for value in (item.values() if isinstance(item, dict) else [item]):
            out += _nav_pages(value) if isinstance(value, list) else [value]
    return out


def test_the_readme_is_short_and_says_the_two_commands_and_the_example():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    assert "make demo" in text and "make test" in text and "<!-- python-api -->" in text


GENERATED = {"reference/config.md", "reference/cli.md"}  # written when the site is built (docs/hooks.py)


def test_every_relative_link_of_the_readme_and_the_pages_resolves():
    bad = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://|#|mailto:", target):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            generated = path.is_relative_to(REPO / "docs") and str(path.relative_to(REPO / "docs")) in GENERATED
            if not path.exists() and not generated:
                bad.append(f"{page.relative_to(REPO)}: {target}")
    assert not bad, "\n".join(bad)


def test_every_page_is_in_the_site_and_every_nav_entry_exists():
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    nav = set(_nav_pages(config["nav"]))
    pages = {str(p.relative_to(REPO / "docs")) for p in (REPO / "docs").rglob("*.md")}
    sections = {p for p in pages if p.startswith("results/")}  # make results' section pages
    assert (pages - sections) | GENERATED == nav, ((pages - sections) | GENERATED) ^ nav
    summary = (REPO / "docs" / "RESULTS.md").read_text()
    assert all(f"]({p})" in summary for p in sections), "every section page is linked from the summary"


def test_the_config_reference_is_generated_from_every_key_with_its_resume_class():
    from widedp.trainer.config import Config
    from widedp.trainer.config.semantics import KEY_CLASSES, config_keys

    page = hooks.config_reference()
    for key in config_keys(Config().to_dict()):
        if "." in key:
            assert f"`{key}`" in page, key
    assert f"`privacy.unit` | str | `'example'` | {KEY_CLASSES['privacy.unit']} |" in page


def test_the_cli_reference_is_generated_from_every_command():
    from widedp.trainer.cli import COMMAND_HELP

    page = hooks.cli_reference()
    for name in COMMAND_HELP:
        assert f"## widedp {name}\n" in page, name
    assert "--noise-multiplier" in page and "--resume" in page


@pytest.mark.parametrize("marker", ["python-api", "own-model"])
def test_the_readme_example_is_the_one_the_api_test_runs(marker):
    from readme_blocks import page_with

    assert page_with(f"<!-- {marker} -->") == REPO / "README.md"
