"""The models: the frozen target and its features, the DFlash drafter (also the served remote code), the loss,
the kernels a hybrid target needs, a model's config.json read checked, and the serving contract."""
