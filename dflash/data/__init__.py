"""The data: chat records rendered as serving shows them, the corpus pass prepare-data and regen share, the
token store, training samples and batch plans, regen, and the demo's tiny target and corpus."""
