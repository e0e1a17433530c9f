"""What keying every privacy draw with the full secret costs: the noise of one step, before and after.

Before (main until this change): torch's CPU generator seeded with `manual_seed` (32 bits kept),
one generator per 1024-row block for DP-SGD's every-row noise (`trainer/engine/layout.py`), one
sequential generator for the selected rows and the dense parameters. After: the key's AES-128-CTR
keystream through a float32 Box–Muller (`selection/keyed_random.py`), and in secure mode AES-256 with the 4-draw
Gaussian. Measured in one process, one after another, on the step shapes of
benchmarks/dlrm_compare.py (26 tables × `--rows` rows, dim 16; `--selected` rows of a sparse
step and the DLRM's dense parameters), median of `--repeats`:

  dpsgd-every-row   every row of every table (what a DP-SGD step and a dense table draw)
  sparse-step       the selected rows as one [k, 16] draw, then every dense parameter

The "before" rows re-implement the removed code here (it is no longer in the package); the
"after" rows call the package. Ratios are after / before from the same run. No timing asserts:
the numbers are for RESULTS.md (section "Noise generators").

    python benchmarks/noise_generators.py [--quick] [--rows 262144] [--selected 20000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import announce_machine, format_table, write_results  # noqa: E402
from widedp.selection.keyed_random import GaussianStream, NoiseKey  # noqa: E402
from widedp.selection.noise import gaussian_noise  # noqa: E402
from widedp.trainer.engine.layout import row_block_normal  # noqa: E402

ROW_BLOCK = 1024  # the removed code's rows per torch generator

DIM, TABLES = 16, 26
DENSE_PARAMETERS = 13 * 64 + 64 + 64 * 64 + 64 + 64 + 1 + 27 * 16 * 64  # DLRM-sized dense part, order of magnitude


# ---- before: the removed torch-generator code, verbatim in behaviour ----------------------------

def _old_block_seed(seed: int, domain: str, step: int, table: int, block: int) -> int:
    import hashlib

    digest = hashlib.blake2b(f"{seed}/{domain}/{step}/{table}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _old_torch_noise(shape, std, gen, secure):
    if not secure:
        return torch.normal(0.0, std, size=tuple(shape), generator=gen, dtype=torch.float32)
    noise = torch.zeros(tuple(shape), dtype=torch.float64)
    for _ in range(4):
        noise += torch.normal(0.0, std, size=tuple(shape), generator=gen, dtype=torch.float64)
    return (noise / 2.0).float()


def _old_row_block_normal(seed, domain, step, table, start, end, dim, std, secure):
    out = torch.empty((end - start, dim), dtype=torch.float32)
    r = start
    while r < end:
        blk = r // ROW_BLOCK
        gen = torch.Generator().manual_seed(_old_block_seed(seed, domain, step, table, blk))
        values = _old_torch_noise((ROW_BLOCK, dim), 1.0, gen, secure)
        hi = min(end, (blk + 1) * ROW_BLOCK)
        out[r - start: hi - start] = values[r - blk * ROW_BLOCK: hi - blk * ROW_BLOCK]
        r = hi
    return out.mul_(std)


# ---- the two step shapes, each way ----------------------------------------------------------------

def dpsgd_every_row(way: str, rows: int, step: int) -> None:
    for t in range(TABLES):
        if way.startswith("before"):
            _old_row_block_normal(12345, "dpsgd", step, t, 0, rows, DIM, 0.1, secure=way.endswith("secure"))
        else:
            row_block_normal(KEYS[way], "dpsgd", step, t, 0, rows, DIM, 0.1)


def sparse_step(way: str, selected: int, gen) -> None:
    secure = way.endswith("secure")
    draw = _old_torch_noise if way.startswith("before") else (lambda s, std, g, sec: gaussian_noise(s, std, g, secure=sec))
    draw((selected, DIM), 0.1, gen, secure)
    draw((DENSE_PARAMETERS,), 0.1, gen, secure)


KEYS = {"after": NoiseKey(0x0123456789ABCDEF_0123456789ABCDEF),
        "after-secure": NoiseKey(0x0123456789ABCDEF_0123456789ABCDEF, secure=True)}
WAYS = ("before", "after", "before-secure", "after-secure")
LABELS = {"before": "torch manual_seed (32-bit key)", "after": "AES-128-CTR, 128-bit key",
          "before-secure": "torch manual_seed, 4-draw", "after-secure": "AES-256-CTR, 256-bit key, 4-draw"}


def _median_ms(fn, repeats: int) -> float:
    fn(0)  # warm-up
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        fn(i + 1)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(rows: int, selected: int, repeats: int) -> list[dict]:
    out = []
    for way in WAYS:
        gen = (torch.Generator().manual_seed(12345) if way.startswith("before") else GaussianStream(KEYS[way]))
        every = _median_ms(lambda i: dpsgd_every_row(way, rows, i), repeats)
        sparse = _median_ms(lambda i: sparse_step(way, selected, gen), repeats)
        out.append({"way": way, "generator": LABELS[way], "dpsgd_every_row_ms": every, "sparse_step_noise_ms": sparse})
        print(f"{way:14s} dpsgd every row {every:9.1f} ms   sparse step noise {sparse:8.2f} ms", flush=True)
    return out


def results_section(doc: dict) -> tuple[list[str], list]:
    s = doc["setting"]
    by = {r["way"]: r for r in doc["rows"]}
    lines = [f"The noise one step draws, {s['tables']} tables × {s['rows']:,} rows × dim {s['dim']} (DP-SGD: every row) "
             f"and {s['selected']:,} selected rows + {s['dense_parameters']:,} dense parameters (a sparse step); "
             f"median of {s['repeats']}, one process, `{doc['command']}`. *Before* is main until the keyed generators "
             "(torch's generator, whose `manual_seed` keeps 32 bits: reproducible from a 2^32 search).", "",
             "| generator | DP-SGD every-row noise, ms | × before | sparse-step noise, ms | × before |",
             "|---|---:|---:|---:|---:|"]
    for way in WAYS:
        r = by[way]
        base = by["before-secure" if way.endswith("secure") else "before"]
        lines.append(f"| {r['generator']} | {r['dpsgd_every_row_ms']:.1f} | "
                     f"{r['dpsgd_every_row_ms'] / base['dpsgd_every_row_ms']:.2f} | {r['sparse_step_noise_ms']:.2f} | "
                     f"{r['sparse_step_noise_ms'] / base['sparse_step_noise_ms']:.2f} |")
    return lines, []


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2000 rows per table, 2000 selected, 3 repeats")
    parser.add_argument("--rows", type=int, default=None, help="rows per table (default 262144, dlrm_compare's large size)")
    parser.add_argument("--selected", type=int, default=None, help="selected rows of a sparse step (default 20000)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    rows = args.rows or (2000 if args.quick else 262_144)
    selected = args.selected or (2000 if args.quick else 20_000)
    repeats = args.repeats or (3 if args.quick else 5)
    started = time.time()
    machine = announce_machine()
    result = measure(rows, selected, repeats)
    print(format_table(["way", "dpsgd every row ms", "sparse step ms"],
                       [[r["way"], f"{r['dpsgd_every_row_ms']:.1f}", f"{r['sparse_step_noise_ms']:.2f}"] for r in result]))
    write_results("noise_generators", {"setting": {"rows": rows, "tables": TABLES, "dim": DIM, "selected": selected,
                                                   "dense_parameters": DENSE_PARAMETERS, "repeats": repeats},
                                       "rows": result}, quick=args.quick, machine=machine, out=args.out, started=started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
