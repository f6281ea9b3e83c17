"""Loading compiled steps on real devices, timing them, and summarizing xprof traces."""
