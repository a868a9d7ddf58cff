"""The parts a training run is assembled from; ``recsys_jax.train`` holds the loop.

In the order data flows through them:

- ``validation``: config values checked before anything is built; the dense optimizer.
- ``specs``: table and feature specs from the reader's schema and ``config.embeddings``.
- ``feed``: the host worker threads that read, parse and dedup batches ahead, in order.
- ``host``: the host half of a step (dedup, PS lookup, placement on the mesh, push).
- ``steps``: the jitted train and eval steps and the dense train state they update.
- ``job``: builds reader, PS, mesh, model, steps and initial state from a config.
- ``evaluation``: exact AUC and logloss over the eval set.
- ``run_checkpoints``: resuming a run and saving its consistent cuts.
- ``run_config``: the run's config written into the workdir (and read back by serving).
- ``writers``: what a run writes for people: progress bar, metrics.jsonl, TensorBoard, summary.
"""
