#!/bin/sh
# Regenerates grpc_predict_v2_pb2.py from grpc_predict_v2.proto (the definitions of KServe's
# docs/predict-api/v2/grpc_predict_v2.proto: the same messages and field numbers) with grpcio-tools as requirements.txt pins it. The messages are built in a descriptor pool of their own,
# not protobuf's default one: tritonclient's messages have the same names (package inference) and would clash there
# in a process that holds both. tests/serving/test_v2.py checks the committed file is what this makes.
set -e
cd "$(dirname "$0")"
"${PYTHON:-python}" -m grpc_tools.protoc -I. --python_out=. grpc_predict_v2.proto
sed -i 's/^DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile(/DESCRIPTOR = _descriptor_pool.DescriptorPool().AddSerializedFile(/' grpc_predict_v2_pb2.py
grep -q '_descriptor_pool.DescriptorPool().AddSerializedFile' grpc_predict_v2_pb2.py
