"""The onnxps server: kernels, state store, gRPC service, CLI."""
