"""Fine-tuning on images in Ray: trainer actors holding clients' images, their pool, the training backend."""
