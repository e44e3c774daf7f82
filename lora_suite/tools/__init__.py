"""Offline tools that read reports and the ledger, never run models: ledger, compare, history, scorecard, acceptance."""
