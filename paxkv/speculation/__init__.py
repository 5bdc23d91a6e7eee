"""Speculative decoding: draft proposers, the adaptive draft budget, and the config."""
