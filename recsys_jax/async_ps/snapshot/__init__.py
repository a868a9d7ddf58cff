"""PS snapshots on disk: one snapshot directory (``directory``) and the chain of full and incremental snapshots a checkpoint names (``chain``)."""
