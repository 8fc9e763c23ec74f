"""QoQ (W4A8KV4) quantization: offline transforms and weight quantization."""
