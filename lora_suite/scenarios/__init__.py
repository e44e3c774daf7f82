"""Long runs, aged-vs-fresh, multi-GPU workers, the interleaved training benchmark."""
