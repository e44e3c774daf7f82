"""The results tools, which read reports and the ledger and never run models: ledger, results store, compare,
history, scorecard, acceptance."""
