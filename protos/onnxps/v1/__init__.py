"""Generated protobuf and gRPC modules of the onnxps.v1 wire contract."""
