"""The pytest plugin, the Tier a tier test uses, the run report."""
