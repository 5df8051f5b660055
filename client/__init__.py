"""onnxps client."""
