"""What serving engines read and how a drafter does there: export (HF and speculators layouts),
`dflash bench serve`, an engine's /metrics figures, and the `dflash bench` commands."""
