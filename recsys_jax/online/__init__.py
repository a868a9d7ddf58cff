"""What online training adds to the training loop: progressive validation (``progressive``: each
batch scored before it is trained on) and rows published for serving between checkpoints
(``publish``). The stream source itself is a data reader (``recsys_jax.data.follow``)."""
