"""Replicas of the engine behind Ray Serve, with KV-cache-aware routing. `router` is plain Python (the
routing simulator runs it too); the modules that import Ray are imported only when serving."""
