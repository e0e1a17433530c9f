"""Private learners and estimators for sparse data (seed A's Algorithm 2, seed D's mechanisms).

A pure library: numpy/scipy only, no Ray, no torch, importable without the trainer. Every
function states its neighbouring relation and sensitivity and returns its output together with
the privacy event(s) our accountants compose (`accounting/`).
"""
