"""Attention metadata, metadata builders, backends (torch, Triton) and the KV write."""
