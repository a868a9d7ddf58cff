"""What the scripts in experiments/ share: where they write, summary statistics, synthetic ids and
text, the interpreter-lock sampler, the tier's file layouts, and starting a trainer or a server.

Scripts import these modules (``from harness import stats``; a script's own folder is first on
``sys.path``) and never each other.
"""
