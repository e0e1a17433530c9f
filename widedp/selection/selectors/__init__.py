"""The selectors, one file each; importing this package registers them all. The built-in ones
first, in this order (the order of the config/CLI choices), then any other module of this
package in name order — so a new selector is its file here (plus its tests), nothing else."""

import importlib
import pkgutil

_BUILT_IN = ("em", "svt", "noisy_max", "threshold", "random", "fest")

for _name in (*_BUILT_IN, *sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in _BUILT_IN)):
    importlib.import_module(f"{__name__}.{_name}")
