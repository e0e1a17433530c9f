"""MkDocs hooks (mkdocs.yml `hooks:`): the reference pages generated when the site is built —
the command line from the `widedp` parser itself, every config key from the config dataclasses
(their types, defaults and the comments above each field in trainer/config/__init__.py) with
its class for resumes (trainer/config/semantics.py). Nothing generated is committed: the pages
cannot go stale."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import textwrap
from contextlib import redirect_stdout


def _field_comments(cls) -> dict[str, str]:
    """{field name: the comment lines right above it (and its trailing comment)} from the source."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    out: dict[str, str] = {}
    for node in ast.parse(source).body[0].body:  # type: ignore[attr-defined]
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        above, i = [], node.lineno - 2
        while i >= 0 and lines[i].strip().startswith("#"):
            above.insert(0, lines[i].strip().lstrip("#").strip())
            i -= 1
        line = lines[node.lineno - 1]
        trailing = line.split("#", 1)[1].strip() if "#" in line and not line.strip().startswith("#") else ""
        out[node.target.id] = " ".join(above + ([trailing] if trailing else []))
    return out


def config_reference() -> str:
    from widedp.trainer import config as config_module
    from widedp.trainer.config import semantics

    out = ["# Configuration reference", "",
           "Every key of a training config (TOML; `--set section.key=value` on the command line), generated from "
           "the config dataclasses when the site is built. *Resume* is the key's class for `widedp train --resume` "
           "(see [Resume, the ledger and the budget](../guide/resume-and-budget.md)): **fixed** keys are what the "
           "run's ε means and cannot change; **charged** keys change later steps, every session's events charged; "
           "**sticky** keys may change but their weaker meaning holds for the whole run; **free** and **initial** "
           "keys change nothing a resume computes.", ""]
    sections = [(name, type(getattr(config_module.Config(), name))) for name in config_module.SECTIONS]
    for name, cls in sections:
        doc = inspect.getdoc(cls) or ""
        out += [f"## [{name}]", ""] + ([doc, ""] if doc and not doc.startswith(cls.__name__ + "(") else [])
        out += ["| key | type | default | resume | what it is |", "|---|---|---|---|---|"]
        comments = _field_comments(cls)
        for field in dataclasses.fields(cls):
            default = field.default if field.default is not dataclasses.MISSING else (
                field.default_factory() if field.default_factory is not dataclasses.MISSING else "")
            kind = field.metadata.get("kind")
            typ = kind.__name__ if isinstance(kind, type) else (field.type if isinstance(field.type, str) else
                                                                getattr(field.type, "__name__", str(field.type)))
            extra = " or \"auto\"" if field.metadata.get("auto") else " or \"none\"" if field.metadata.get("none") else ""
            what = field.metadata.get("help") or comments.get(field.name, "")
            klass = semantics.KEY_CLASSES.get(f"{name}.{field.name}", "")
            cell = str(what).replace("|", "\\|").replace("__", "\\_\\_")
            out.append(f"| `{name}.{field.name}` | {typ}{extra} | `{default!r}` | {klass} | {cell} |")
        out.append("")
    return "\n".join(out)


def cli_reference() -> str:
    from widedp.trainer.cli import COMMAND_HELP, build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    out = ["# Command-line reference", "",
           "`widedp COMMAND ...` — every command prints one JSON object on stdout; a bad argument or a refusal "
           "exits with code 2 and one line on stderr. Generated from the parser when the site is built.", ""]
    for name in COMMAND_HELP:
        command = sub.choices[name]  # type: ignore[attr-defined]
        buf = io.StringIO()
        with redirect_stdout(buf):
            command.print_help()
        out += [f"## widedp {name}", "", COMMAND_HELP[name][1], "", "```text", buf.getvalue().rstrip(), "```", ""]
    return "\n".join(out)


def on_files(files, config):
    from mkdocs.structure.files import File

    for path, content in (("reference/config.md", config_reference()), ("reference/cli.md", cli_reference())):
        files.append(File.generated(config, path, content=content))
    return files
