"""`dflash train`: the run (run.py) and the pipeline's parts: target and drafter replicas, the one feature
queue, compile and warm-up, averaging, nodes, resume, divergence, held-out eval, metrics, fault injection."""
