"""TCT (Yu et al., NeurIPS 2022): federated learning convexified with bootstrapped neural tangent kernels."""
