"""How users drive the engine: LLM (Python), the paxkv command line, prompt files, the planner."""
