"""The remote parameter server's client: ``RemotePS``, offering the in-process PS's methods over gRPC to shard server processes."""
