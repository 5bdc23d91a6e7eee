"""The engine and what it hands back: Engine, EngineConfig, the output processor, outputs and metrics."""
