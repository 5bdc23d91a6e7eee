"""The device side: a scheduled batch as arrays, the jitted step, the KV pool and swap space, the model runner."""
