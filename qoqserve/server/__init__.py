"""OpenAI-compatible HTTP server over the step-wise engine."""
