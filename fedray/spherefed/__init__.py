"""SphereFed (Dong et al., ECCV 2022): a fixed hyperspherical classifier during training, closed-form calibration after."""
