"""The engine layer: one run from a configuration, its stages (closed form, training, calibration, TCT), the round
loop with its callbacks, checkpoints."""
