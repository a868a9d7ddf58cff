"""Serving a trained model: scoring requests of raw records with a workdir's newest checkpoint."""
