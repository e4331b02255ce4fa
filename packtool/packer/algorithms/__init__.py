"""Planning: item lengths in, pack ids out. Pure numpy functions, one module per family of algorithms.

- :func:`pack_lengths` (:mod:`.pack`): the entry point; :data:`ALGORITHMS` / :data:`PLANNERS`
  (:mod:`.registry`, :mod:`.pack`): the algorithm names and their implementations;
  ``bfd`` (:mod:`.bestfit`), ``ffd`` and ``first_fit_shuffle`` (:mod:`.firstfit`), ``greedy_knapsack``
  (:mod:`.fill`), ``balanced_greedy_knapsack`` (:mod:`.balanced`), ``sequential`` (:mod:`.nextfit`).
- :func:`derive_align`, :func:`l1_bound`, :func:`compare`: alignment from parallelism, the token lower bound
  on packs, and a side-by-side run of algorithms.
- :func:`balance_dp`, :func:`dp_imbalance` (:mod:`.dp`): pack order for data-parallel steps.
"""

from typing import Any

from packtool.packer.algorithms.dp import balance_dp, dp_imbalance, pack_compute
from packtool.packer.algorithms.pack import PLANNERS, compare, l1_bound, pack_lengths
from packtool.packer.algorithms.registry import ALGORITHMS, Algorithm

__all__ = ["ALGORITHMS", "PLANNERS", "Algorithm", "balance_dp", "compare", "derive_align", "dp_imbalance",
           "l1_bound", "pack_compute", "pack_lengths"]


def __getattr__(name: str) -> Any:
    if name == "derive_align":  # the settings' rule (settings take the algorithm names from here: no import cycle)
        from packtool.settings import derive_align

        return derive_align
    raise AttributeError(f"module 'packtool.packer.algorithms' has no attribute {name!r}")
