"""`dflash eval`: exact speculative decoding and tau, the published suites and tables, and the plots."""
