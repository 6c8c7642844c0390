"""Training's maths on one process: local SGD by autograd and in the dual form of linear heads, server optimizers,
learning-rate schedules, what a training backend is, and fine-tuning's local work on images."""
