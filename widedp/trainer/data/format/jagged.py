"""TorchRec's `KeyedJaggedTensor` (the batch type end to end) without torchrec's package `__init__`.

`from torchrec.sparse.jagged_tensor import KeyedJaggedTensor` first runs `torchrec/__init__.py`,
which imports torchrec.distributed (sharding planners, model parallel, tensordict, scipy.signal
through torch._decomp): about 2-3 s of start-up in every process that builds a batch — each
trainer, shard and Ray actor, each `widedp` command, each test worker. The jagged types need only
torch, fbgemm_gpu's sparse operators (`torch.ops.fbgemm.*`, registered by `import fbgemm_gpu`)
and two small torchrec modules: `torchrec/pt2/checks.py` and `torchrec/streamable.py`.

Importing this module loads `torchrec.pt2.checks`, `torchrec.streamable` and
`torchrec.sparse.jagged_tensor` under their own names with bare stand-ins for the packages
`torchrec` and `torchrec.sparse` present only while they load (the pattern of
accounting/_dp_event_light.py). The classes are torchrec's own: when something later imports
`torchrec` in full, its `__init__` runs for real and binds the very modules loaded here, so
`torchrec.KeyedJaggedTensor is widedp.trainer.data.format.jagged.KeyedJaggedTensor`
(tests/test_cli_startup.py checks it). Nothing is done when torchrec is already imported.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm, which the jagged types call)

#: The torchrec modules the jagged types need (in dependency order); nothing else of the library.
LIGHT_MODULES = ("torchrec.pt2.checks", "torchrec.streamable", "torchrec.sparse.jagged_tensor")
_PACKAGES = ("torchrec", "torchrec.sparse")


def _load_light_modules() -> None:
    if "torchrec" in sys.modules or all(name in sys.modules for name in LIGHT_MODULES):
        return
    stand_ins = {}
    for name in _PACKAGES:  # bare package objects (their __path__ only): the packages do not run
        spec = importlib.util.find_spec(name)
        if spec is None or spec.submodule_search_locations is None:
            break  # not installed as a package: the plain import below says so
        stand_ins[name] = sys.modules[name] = importlib.util.module_from_spec(spec)
    try:
        if len(stand_ins) == len(_PACKAGES):
            for name in LIGHT_MODULES:
                importlib.import_module(name)
    finally:
        for name, module in stand_ins.items():
            if sys.modules.get(name) is module:
                del sys.modules[name]


_load_light_modules()

from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor  # noqa: E402

__all__ = ["JaggedTensor", "KeyedJaggedTensor"]
