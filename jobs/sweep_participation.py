"""The participation sweep (jobs/sweeps/participation.yaml) with its summary table and figures: ``python -m jobs.sweep_participation``."""

from jobs.standard_sweep import main

if __name__ == "__main__":
    main("participation")
