"""Planning: item lengths in, pack ids out. Pure numpy functions, one module per family of algorithms.

- :func:`pack_lengths` / :data:`ALGORITHMS` (:mod:`.pack`): the entry point and its algorithm names;
  ``bfd`` (:mod:`.bestfit`), ``ffd`` and ``first_fit_shuffle`` (:mod:`.firstfit`), ``greedy_knapsack``
  (:mod:`.fill`), ``balanced_greedy_knapsack`` (:mod:`.balanced`), ``sequential`` (:mod:`.nextfit`).
- :func:`derive_align`, :func:`l1_bound`, :func:`compare`: alignment from parallelism, the token lower bound
  on packs, and a side-by-side run of algorithms.
- :func:`balance_dp`, :func:`dp_imbalance` (:mod:`.dp`): pack order for data-parallel steps.
"""

from packtool.build.algorithms.dp import balance_dp, dp_imbalance, pack_compute
from packtool.build.algorithms.pack import ALGORITHMS, compare, derive_align, l1_bound, pack_lengths

__all__ = ["ALGORITHMS", "balance_dp", "compare", "derive_align", "dp_imbalance", "l1_bound", "pack_compute",
           "pack_lengths"]
