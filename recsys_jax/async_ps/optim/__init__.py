"""Row optimizers: the updates the parameter server applies to the rows a push names (SGD, Adagrad, Adam, ...)."""
