"""Auditing: measuring what a run's privacy claim allows, beside `accounting`, which states the
claim. Accounting says what is claimed (events, accountants, the ledger's ε); auditing measures
it — empirical lower bounds on ε from one training run with canaries (`one_run_audit`, Steinke,
Nasr & Jagielski 2023), its Gaussian-DP refinement (`fdp_one_run`, Mahloujifar, Melis &
Chaudhuri 2025), the threshold audit over independent trials (`threshold_audit`, Nasr et al.
2023), conformance tests of a run's randomness against the distribution its claim states
(`conformance`: Poisson sampling, Gaussian thresholding), the canary exposure test
(`canary_exposure`, Carlini et al. 2019), the
canaries themselves (`canaries`) and the auditor's scores of a released model (`scores`).

Import rule (a pure library, like `selection` and `accounting`): auditing imports the standard
library, numpy, scipy and `widedp.accounting` (what is claimed) — nothing else of widedp, no
torch/torchrec and no Ray. It measures from arrays (scores, membership coins, released rows) and
public data-set metadata; driving a training run with the canaries (the deliberately broken
variants, reading rows from the shards, `widedp audit`) is the trainer's, in trainer/run/audit.py,
which calls auditing. tests/test_package_boundaries.py checks the rule.
"""

if __name__ != "widedp.auditing":  # the repository's top-level auditing/ is a link to widedp/auditing/ (README, "Layout")
    raise ImportError(f"import widedp.auditing, not {__name__}: each module exists once, under widedp (a second "
                      "copy under another name would hold second copies of its registries)")

from widedp.auditing.canaries import (
    CANARY_KINDS,
    GRADIENT_CANARY_SCALE,
    PHRASE_PLACEMENTS,
    Canaries,
    as_gradient_canaries,
    canary_features,
    make_canaries,
    make_phrase_examples,
)
from widedp.auditing.canary_exposure import CanaryExposureReport, exposure_report
from widedp.auditing.conformance import poisson_sampling_test, threshold_selection_test
from widedp.auditing.fdp_one_run import epsilon_lower_bound_gdp, gdp_epsilon, gdp_mu_lower_bound, gdp_mu_of_epsilon
from widedp.auditing.one_run_audit import OneRunAudit, audit_from_scores, epsilon_lower_bound
from widedp.auditing.threshold_audit import ThresholdAudit, clopper_pearson_upper, threshold_audit
from widedp.auditing.scores import (guess_counts, phrase_log_perplexities, robust_step_scales, step_projections,
                                    subsampled_gaussian_log_likelihood_ratios, tie_broken, white_box_scores)

__all__ = [
    "CANARY_KINDS",
    "GRADIENT_CANARY_SCALE",
    "PHRASE_PLACEMENTS",
    "Canaries",
    "CanaryExposureReport",
    "OneRunAudit",
    "ThresholdAudit",
    "as_gradient_canaries",
    "audit_from_scores",
    "canary_features",
    "clopper_pearson_upper",
    "epsilon_lower_bound",
    "epsilon_lower_bound_gdp",
    "exposure_report",
    "gdp_epsilon",
    "gdp_mu_lower_bound",
    "gdp_mu_of_epsilon",
    "guess_counts",
    "make_canaries",
    "make_phrase_examples",
    "phrase_log_perplexities",
    "poisson_sampling_test",
    "robust_step_scales",
    "step_projections",
    "subsampled_gaussian_log_likelihood_ratios",
    "threshold_audit",
    "threshold_selection_test",
    "tie_broken",
    "white_box_scores",
]
