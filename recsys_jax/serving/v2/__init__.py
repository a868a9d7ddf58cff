"""The Open Inference Protocol (KServe v2) beside ``/v1``: ``codec`` (tensors <-> records, metadata),
``rest`` (HTTP), ``rpc`` (gRPC: the messages of KServe's ``grpc_predict_v2.proto`` and their generated code)."""
