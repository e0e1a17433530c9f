"""Adaptive clipping by private statistics (seed C: DP-STAT, DP-AMBSSGD and DP-SSGD), and
amplification by shuffling for pure ε₀-DP local randomizers (`shuffling`; not applied to DP-SSGD).

A pure library: numpy/scipy only, no Ray, no torch, importable without the trainer. Every
mechanism states its neighbouring relation and sensitivity and returns its privacy event(s).
"""
