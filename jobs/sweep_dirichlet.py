"""The dirichlet sweep (jobs/sweeps/dirichlet.yaml) with its summary table and figures: ``python -m jobs.sweep_dirichlet``."""

from jobs.standard_sweep import main

if __name__ == "__main__":
    main("dirichlet")
