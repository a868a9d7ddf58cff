"""A trained model's embedding rows for serving: read on demand from a checkpoint's PS snapshot chain
(``snapshot_rows``) behind a bounded row cache (``cache``), from files the served version holds for as
long as it is served (``held``)."""
