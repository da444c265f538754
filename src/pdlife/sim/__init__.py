"""One simulated rank: its parts (ledger, bytes, requests, hooks, soak, stats) and the loops that run over them."""
