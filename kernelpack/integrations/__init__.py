"""Integrations that bring the node's active kernels to serving stacks (captured graphs, transformers)."""
