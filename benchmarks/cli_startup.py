"""How fast `widedp` answers when no training is needed: help, config errors, the privacy commands.

Each command runs as a fresh process (the `widedp` script of the active environment), `--repeats`
times after one warm-up (the page cache holds the files); the table gives the median wall time
beside the interpreter's own start (`python -c pass`) and `import torch` (the floor of anything
that touches a model). Goal (issue 28): `widedp --help` and config errors in < 1.5 s.

  help               widedp --help (lists every command from cli.COMMAND_HELP: no command module imported)
  train-help         widedp train --help (imports only trainer/cli/train.py)
  config-key-error   widedp train --config BAD.toml with a mistyped key (read and checked before torch/Ray)
  config-type-error  widedp train --config configs/quickstart.toml --set train.steps=abc
  config-name-error  --set train.optimizer=foo: a name checked against a registry (optimizers, models,
                     selectors, accountants), which imports torch, FBGEMM and dp_accounting to read it
  epsilon            widedp epsilon for a DP-SGD run (dp_accounting, Opacus's RDP analysis)

No timing asserts: the numbers are for RESULTS.md ("CLI start-up").

    python benchmarks/cli_startup.py [--quick] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO, announce_machine, format_table, write_results  # noqa: E402

GOAL_SECONDS = 1.5


def _widedp() -> str:
    found = Path(sys.executable).with_name("widedp")
    return str(found) if found.exists() else (shutil.which("widedp") or "widedp")


def commands(bad_config: Path) -> dict[str, list[str]]:
    w = _widedp()
    return {
        "python-start": [sys.executable, "-c", "pass"],
        "import-torch": [sys.executable, "-c", "import torch"],
        "help": [w, "--help"],
        "train-help": [w, "train", "--help"],
        "config-key-error": [w, "train", "--config", str(bad_config)],
        "config-type-error": [w, "train", "--config", "configs/quickstart.toml", "--set", "train.steps=abc"],
        "config-name-error": [w, "train", "--config", "configs/quickstart.toml", "--set", "train.optimizer=foo"],
        "epsilon": [w, "epsilon", "--noise-multiplier", "1.1", "--sample-rate", "0.01", "--steps", "1000",
                    "--delta", "1e-5"],
    }


def _seconds(cmd: list[str]) -> tuple[float, int]:
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    return time.perf_counter() - t0, done.returncode


def measure(repeats: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        bad = Path(tmp) / "bad.toml"
        bad.write_text("[train]\nstepz = 3\n")
        rows = []
        for name, cmd in commands(bad).items():
            _seconds(cmd)  # warm-up
            times, codes = zip(*(_seconds(cmd) for _ in range(repeats)))
            shown = [Path(cmd[0]).name, *("BAD.toml" if a == str(bad) else a for a in cmd[1:])]
            rows.append({"command": name, "argv": " ".join(shown),
                         "median_s": statistics.median(times), "min_s": min(times), "exit_code": codes[0]})
            print(f"{name}: {statistics.median(times):.2f} s", flush=True)
    return rows


def results_section(doc: dict) -> tuple[list[str], list]:
    s = doc["setting"]
    lines = [f"Each command a fresh process, median of {s['repeats']} after a warm-up, `{doc['command']}`. "
             f"Goal: `widedp --help` and config errors < {GOAL_SECONDS} s.", "",
             "| command | median s | exit code |", "|---|---:|---:|"]
    for r in doc["rows"]:
        lines.append(f"| `{r['argv']}` | {r['median_s']:.2f} | {r['exit_code']} |")
    return lines, []


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    repeats = args.repeats or (2 if args.quick else 5)
    started = time.time()
    machine = announce_machine()
    rows = measure(repeats)
    print(format_table(["command", "median s", "exit"], [[r["command"], f"{r['median_s']:.2f}", r["exit_code"]] for r in rows]))
    write_results("cli_startup", {"setting": {"repeats": repeats, "goal_seconds": GOAL_SECONDS}, "rows": rows},
                  quick=args.quick, machine=machine, out=args.out, started=started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
