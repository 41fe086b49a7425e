"""The router: OpenAI-compatible HTTP and gRPC front ends, the prefix index and the
prefill-to-decode orchestration. Never imports torch."""
