"""`accounting.calibrate` knows no selector: it takes a function building the mechanism's event
from σ, in the manner of dp_accounting's `calibrate_dp_mechanism` (issue 28). Selectors supply
their step through `selection.calibration` (tests/test_selector_registry.py,
tests/test_cli_trainer_agreement.py check those numbers)."""

from __future__ import annotations

import ast
import math
import subprocess
import sys
from pathlib import Path

import pytest
from dp_accounting import dp_event, mechanism_calibration
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import stats

from widedp.accounting import calibrate, make_accountant
from widedp.accounting import events as ev
from widedp.accounting.calibration import RHO_FLOOR, UnreachableTargetError

REPO = Path(__file__).resolve().parents[1]


def _imported_modules(text: str, package: str) -> list[str]:
    """Every module an import statement in `text` names (function bodies included), relative
    imports resolved from `package` (the package of the file the text is)."""
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out += [base] + [f"{base}.{a.name}" for a in node.names]
    return out


def _selection_imports(text: str) -> list[str]:
    names = _imported_modules(text, "widedp.accounting")
    return [n for n in names if n == "widedp.selection" or n.startswith("widedp.selection.")]


def test_calibration_imports_nothing_from_selection():
    text = (REPO / "widedp" / "accounting" / "calibration.py").read_text()
    assert _imported_modules(text, "widedp.accounting") and not _selection_imports(text)
    # and at run time: calibrating a DP-SGD step loads no selection (or trainer) module
    body = ("import sys\nfrom widedp.accounting.calibration import calibrate\nfrom widedp.accounting import events as ev\n"
            "calibrate(lambda s: ev.PoissonSampledDpEvent(0.01, ev.GaussianDpEvent(s)), 2.0, 1e-6, steps=100)\n"
            "print(sorted(m for m in sys.modules if m.startswith(('widedp.selection', 'widedp.trainer'))))\n")
    out = subprocess.run([sys.executable, "-c", body], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


def test_the_import_check_sees_a_lazy_or_relative_selection_import():
    """The scan above can fail: the registry imported inside a function, or relatively."""
    assert _selection_imports("def f():\n    from widedp.selection.registry import get_selector\n")
    assert _selection_imports("def f():\n    from ..selection import registry\n")
    assert _selection_imports("import widedp.selection.registry as r\n")
    assert not _selection_imports("from widedp.accounting import events\nfrom . import paper\n")


def _dp_accounting_pld():
    return pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)


def test_a_plain_gaussian_matches_dp_accountings_calibrate_dp_mechanism():
    """A user's builder, σ ↦ GaussianDpEvent(σ): the σ found equals dp_accounting's own
    calibration for the same target (both by PLD with the same discretization), and the exact
    (ε, δ) curve of the Gaussian mechanism (Balle & Wang 2018) confirms it spends the target."""
    eps, delta = 1.0, 1e-5
    ours = calibrate(ev.GaussianDpEvent, eps, delta, accountant="pld")
    theirs = mechanism_calibration.calibrate_dp_mechanism(_dp_accounting_pld, dp_event.GaussianDpEvent, eps, delta)
    assert ours == pytest.approx(theirs, rel=1e-5)
    # Gaussian mechanism, sensitivity 1: δ(ε) = Φ(1/(2σ) − εσ) − e^ε Φ(−1/(2σ) − εσ)
    exact = stats.norm.cdf(0.5 / ours - eps * ours) - math.exp(eps) * stats.norm.cdf(-0.5 / ours - eps * ours)
    assert exact <= delta and exact == pytest.approx(delta, rel=1e-2)


def test_a_sampled_composed_gaussian_matches_dp_accountings_rdp_calibration():
    """T Poisson-sampled Gaussian steps, our RDP accountant against dp_accounting's RdpAccountant
    calibrated by `calibrate_dp_mechanism` on the self-composed event."""
    q, steps, eps, delta = 0.01, 200, 2.0, 1e-6
    ours = calibrate(lambda s: ev.PoissonSampledDpEvent(q, ev.GaussianDpEvent(s)), eps, delta, steps=steps,
                     accountant="rdp")
    theirs = mechanism_calibration.calibrate_dp_mechanism(
        rdp_privacy_accountant.RdpAccountant,
        lambda s: dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(s)), steps),
        eps, delta)
    assert ours == pytest.approx(theirs, rel=1e-4)
    acc = make_accountant("rdp")
    step = ev.PoissonSampledDpEvent(q, ev.GaussianDpEvent(ours))
    assert acc.epsilon([(step, steps)], delta) <= eps
    assert acc.epsilon([(ev.PoissonSampledDpEvent(q, ev.GaussianDpEvent(ours * (1 - 1e-6))), steps)], delta) > eps


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_the_builder_decides_what_sigma_means(accountant):
    """calibrate knows no mechanism: two Gaussians of σ and 2σ are one Gaussian of σ/√(5/4), so
    the σ found for that builder is √(5/4) times the σ of a plain Gaussian."""
    plain = calibrate(ev.GaussianDpEvent, 2.0, 1e-6, accountant=accountant)
    pair = calibrate(lambda s: ev.ComposedDpEvent([ev.GaussianDpEvent(s), ev.GaussianDpEvent(2 * s)]), 2.0, 1e-6,
                     accountant=accountant)
    assert pair == pytest.approx(plain * math.sqrt(1.25), rel=1e-6)


def test_extra_history_and_an_accountant_instance():
    """One-time events are charged beside the steps (less room: more noise), and an
    `Accountant` instance may be given instead of a name."""
    build = lambda s: ev.PoissonSampledDpEvent(0.01, ev.GaussianDpEvent(s))  # noqa: E731
    acc = make_accountant("rdp")
    extra = [(ev.GaussianDpEvent(5.0), 1)]
    alone = calibrate(build, 3.0, 1e-6, steps=300, accountant=acc)
    with_extra = calibrate(build, 3.0, 1e-6, steps=300, accountant=acc, extra_history=extra)
    assert with_extra > alone
    assert acc.epsilon(extra + [(build(with_extra), 300)], 1e-6) <= 3.0


def test_an_unreachable_target_is_refused_with_the_smallest_epsilon():
    """A one-time Gaussian(1) alone spends more than ε = 1: no σ of the steps reaches it."""
    extra = [(ev.GaussianDpEvent(1.0), 1)]
    with pytest.raises(UnreachableTargetError) as info:
        calibrate(ev.GaussianDpEvent, 1.0, 1e-5, extra_history=extra, accountant="rdp")
    smallest = make_accountant("rdp").epsilon(extra + [(ev.GaussianDpEvent(1 / math.sqrt(2 * RHO_FLOOR)), 1)], 1e-5)
    assert info.value.smallest == pytest.approx(smallest) and info.value.smallest > 1.0
    assert "target_epsilon" in str(info.value)


@pytest.mark.parametrize("bad, match", [(dict(target_epsilon=0.0), "target epsilon"),
                                        (dict(target_epsilon=math.inf), "target epsilon"),
                                        (dict(delta=1.0), "delta"), (dict(steps=0), "steps")])
def test_bad_arguments(bad, match):
    kw = dict(target_epsilon=1.0, delta=1e-5, steps=1) | bad
    with pytest.raises(ValueError, match=match):
        calibrate(ev.GaussianDpEvent, kw["target_epsilon"], kw["delta"], steps=kw["steps"])
