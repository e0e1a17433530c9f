"""Adaptive clipping by private statistics (seed C: DP-STAT, DP-AMBSSGD and DP-SSGD), and
amplification by shuffling for pure ε₀-DP local randomizers (`shuffling`; applied to DP-SSGD with
Laplace noise and b = 1 only, never to the Gaussian DP-SSGD).

A pure library: numpy/scipy only, no Ray, no torch, importable without the trainer. Every
mechanism states its neighbouring relation and sensitivity and returns its privacy event(s).
"""

if __name__ != "widedp.adaptive_clipping":  # the repository's top-level adaptive_clipping/ is a link to widedp/adaptive_clipping/ (README, "Layout")
    raise ImportError(f"import widedp.adaptive_clipping, not {__name__}: each module exists once, under widedp (a second "
                      "copy under another name would hold second copies of its registries)")
