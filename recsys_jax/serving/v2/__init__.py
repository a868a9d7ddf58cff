"""The Open Inference Protocol (KServe v2) beside ``/v1``: ``codec`` (tensors <-> records, metadata),
``rest`` (HTTP), ``rpc`` (gRPC, with KServe's ``grpc_predict_v2.proto`` and its generated code)."""
