"""The checking verbs: ``verify`` (:mod:`.packs`, and :mod:`.source` for ``--source``), ``inspect``
(:mod:`.inspect`) and ``stats`` (:mod:`.stats`)."""
