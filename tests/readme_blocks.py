"""Walkthroughs of the README and the docs pages, run as written: the ```bash block after a
`<!-- walkthrough: NAME ... -->` marker (in the one page that holds it), and explicit
substitutions that fail loudly when the block changes shape.

A test may only change a walkthrough through `Walkthrough.replace` / `Walkthrough.append_to_line`,
each of which states why it is needed and refuses to apply unless its text occurs exactly as
often as expected; everything else runs as the README prints it (with `set -e -o pipefail`: a
command that fails fails the test).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def documents() -> list[Path]:
    """The pages a user reads: README.md and the docs site's sources."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def page_with(marker: str) -> Path:
    """The one page holding `marker` (an HTML comment naming a block)."""
    pages = [p for p in documents() if marker in p.read_text()]
    assert len(pages) == 1, f"expected one page with {marker}, found {[str(p.relative_to(ROOT)) for p in pages]}"
    return pages[0]


class Walkthrough:
    def __init__(self, name: str, readme: Path | None = None):
        readme = readme or page_with(f"<!-- walkthrough: {name}")
        text = readme.read_text()
        blocks = re.findall(rf"<!-- walkthrough: {re.escape(name)}\b[^>]*-->\n```bash\n(.*?)```", text, re.S)
        assert len(blocks) == 1, (f"{readme.name}: expected one ```bash block after <!-- walkthrough: {name} -->, "
                                  f"found {len(blocks)}")
        self.name = name
        self.original = blocks[0]
        self.script = blocks[0]
        self.changes: list[str] = []

    def _shape_error(self, what: str, found: int, expected: int, why: str) -> AssertionError:
        return AssertionError(f"README walkthrough {self.name!r} changed shape: expected {expected} × {what}, found "
                              f"{found}; the test's substitution ({why}) no longer applies - update it with the README")

    def replace(self, old: str, new: str, count: int, why: str) -> "Walkthrough":
        found = self.script.count(old)
        if found != count:
            raise self._shape_error(repr(old), found, count, why)
        self.script = self.script.replace(old, new)
        self.changes.append(f"{old!r} -> {new!r} ({why})")
        return self

    def append_to_line(self, prefix: str, extra: str, why: str) -> "Walkthrough":
        """Appends `extra` to the one command starting with `prefix` (after its continuation
        lines; before a trailing comment)."""
        lines = self.script.split("\n")
        starts = [i for i, line in enumerate(lines) if line.startswith(prefix)]
        if len(starts) != 1:
            raise self._shape_error(f"line starting {prefix!r}", len(starts), 1, why)
        i = starts[0]
        while lines[i].rstrip().endswith("\\"):
            i += 1
        code, hash_, comment = lines[i].partition("  #")
        lines[i] = f"{code.rstrip()} {extra}" + (f"  {hash_.strip()}{comment}" if hash_ else "")
        self.script = "\n".join(lines)
        self.changes.append(f"appended {extra!r} to `{prefix}...` ({why})")
        return self

    def bash(self) -> str:
        """The script to run with `bash -c`: errexit, pipefail, each command echoed (-x) after the seconds
        since the start."""
        return "set -e -o pipefail -x\nPS4='+ [${SECONDS}s] '\n" + self.script

    def commands(self) -> list[str]:
        """The block's commands (continuations joined, comments and blank lines dropped)."""
        joined = re.sub(r"\\\n\s*", " ", self.script)
        return [line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]
