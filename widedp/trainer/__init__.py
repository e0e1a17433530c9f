"""The trainer: config, data, models, the engine and its Ray roles, the `widedp` CLI.

Importing it silences, by name, one third-party message no user can act on (the only one: every
other warning of a normal run is fixed at its cause, tests/test_quiet_run.py):
- torch 2.13 logs "is_fx_tracing will return true for both fx.symbolic_trace and torch.export"
  (logger `torch.fx._symbolic_trace`, once per process) when its own
  `torch.nested.nested_tensor_from_jagged` asks whether it is being traced; torchrec's jagged
  tensors call that function. Nothing here traces.
"""

if __name__ != "widedp.trainer":  # the repository's top-level trainer/ is a link to widedp/trainer/ (README, "Layout")
    raise ImportError(f"import widedp.trainer, not {__name__}: each module exists once, under widedp (a second "
                      "copy under another name would hold second copies of its registries)")

import logging as _logging

_logging.getLogger("torch.fx._symbolic_trace").setLevel(_logging.ERROR)
