"""The build side: ``packtool pack`` from the source dataset to packed shards (scan, encode, the encode store,
planning, assembly, the tar writer's callers, ledger, output lifecycle, engine and workers)."""
