"""Model families: each family's token rules for media (:mod:`.qwen2_vl`, :mod:`.nemotron_omni`) and the processor
mode (:mod:`.processor`), where the folder's own processor expands the placeholders."""
