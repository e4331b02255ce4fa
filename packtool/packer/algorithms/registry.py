"""The packing algorithms by name: the one list of their names and the one table of their implementations.

:data:`Algorithm` is the type of the ``algorithm`` setting (defined with the settings, :mod:`packtool.settings`,
which import nothing from the packing side); :data:`PLANNERS` maps each of its names to the function that runs
it. The table is checked against the names when it is built (:func:`check_registry`): a name without an
implementation, or an implementation without a name, is an error at import, never a silent fall back to another
algorithm.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol, get_args

import numpy as np

from packtool.settings import Algorithm  # the names are a setting's type; their implementations live here

#: The names of :data:`Algorithm`, in order.
ALGORITHMS: tuple[Algorithm, ...] = get_args(Algorithm)


class Planner(Protocol):
    """One algorithm: item costs in units of the alignment, the capacity of a pack in units, the segment cap and
    the extra additive limits (see :mod:`packtool.packer.algorithms._common`) in; the pack index of each item out."""

    def __call__(self, units: np.ndarray, cap: int, max_segments: int | None, resources: tuple, *, seed: int,
                 balanced_delta: int) -> np.ndarray: ...


def check_registry(planners: Collection[str], names: tuple[str, ...] = ALGORITHMS) -> None:
    """Raise ``TypeError`` unless ``planners`` (the names of a table of implementations) are exactly the
    algorithm ``names``."""
    missing = [n for n in names if n not in planners]
    extra = [n for n in planners if n not in names]
    if missing or extra:
        raise TypeError(f"the planner registry does not match the algorithm names: "
                        f"{', '.join(missing) or 'none'} without an implementation, "
                        f"{', '.join(extra) or 'none'} without a name")
