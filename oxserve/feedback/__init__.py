"""Engine-independent feedback instruments: workloads, A/B statistics, the experiment
ledger and the machine's measured ceilings (BRIEF §3)."""
