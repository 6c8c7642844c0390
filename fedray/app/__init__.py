"""The application layer: the command line, the Python API, sweeps (Ray Tune), the extraction job, `fedray methods`."""
