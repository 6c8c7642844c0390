"""The heterogeneity sweep (jobs/sweeps/heterogeneity.yaml) with its summary table and figures: ``python -m jobs.sweep_heterogeneity``."""

from jobs.standard_sweep import main

if __name__ == "__main__":
    main("heterogeneity")
