"""Adaptive clipping by private statistics (seed C: DP-STAT, DP-AMBSSGD and DP-SSGD).

A pure library: numpy/scipy only, no Ray, no torch, importable without the trainer. Every
mechanism states its neighbouring relation and sensitivity and returns its privacy event(s).
"""
