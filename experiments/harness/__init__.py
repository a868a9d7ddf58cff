"""What the scripts in experiments/ share, so that they import it and never each other: where they
write (``outputs``), summary statistics (``stats``), synthetic ids and text (``data``), the PS
workload and its memcpy reference (``ps``), a train-only job and its per-step figures (``jobs``),
trainers, servers and paced clients as processes (``processes``), a stream written while a trainer
follows it (``stream``), the interpreter-lock sampler (``gil``) and the disk tier's file layouts
(``tier_files``). A script's own folder is first on ``sys.path``: ``from harness import stats``.
"""
