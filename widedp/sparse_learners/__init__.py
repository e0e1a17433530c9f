"""Private learners and estimators for sparse data (seed A's Algorithm 2, seed D's mechanisms).

A pure library: numpy/scipy only, no Ray, no torch, importable without the trainer. Every
function states its neighbouring relation and sensitivity and returns its output together with
the privacy event(s) our accountants compose (`accounting/`).
"""

if __name__ != "widedp.sparse_learners":  # the repository's top-level sparse_learners/ is a link to widedp/sparse_learners/ (README, "Layout")
    raise ImportError(f"import widedp.sparse_learners, not {__name__}: each module exists once, under widedp (a second "
                      "copy under another name would hold second copies of its registries)")
