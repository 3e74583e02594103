"""The Open Inference Protocol over gRPC (`inference.GRPCInferenceService`), beside the HTTP API in one process."""
