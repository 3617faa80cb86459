"""The Ray Serve handle path's own latency: an ingress deployment calls a replica whose generator yields
33 small batches at once (no engine), streaming, as our client does. Reports first-item latency."""
import asyncio, os, statistics, sys, time
os.environ.setdefault("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")
os.environ.setdefault("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "1.0")
import ray
from ray import serve

@serve.deployment(num_replicas=2, ray_actor_options={"num_cpus": 1})
class Echo:
    async def generate(self, n: int):
        yield []
        for i in range(n):
            yield [i]

@serve.deployment(ray_actor_options={"num_cpus": 0})
class Caller:
    def __init__(self, echo):
        self.h = echo.options(stream=True, method_name="generate")
    async def measure(self, k: int, conc: int) -> list:
        out = []
        async def one():
            t0 = time.perf_counter(); first = None; taken = None
            async for b in self.h.remote(32):
                if taken is None: taken = time.perf_counter() - t0
                elif first is None: first = time.perf_counter() - t0
            out.append((taken * 1000, first * 1000, (time.perf_counter() - t0) * 1000))
        for _ in range(k // conc):
            await asyncio.gather(*(one() for _ in range(conc)))
        return out

ray.init(num_cpus=2, include_dashboard=False)
serve.run(Caller.bind(Echo.bind()), name="floor", route_prefix=None)
async def driver():
  h = serve.get_app_handle("floor")
  await h.measure.remote(20, 1)
  for conc in (1, 4):
    r = await h.measure.remote(200, conc)
    print(f"c={conc}: taken p50 {statistics.median(x[0] for x in r):.2f} ms, first item p50 {statistics.median(x[1] for x in r):.2f} ms, "
          f"33 items p50 {statistics.median(x[2] for x in r):.2f} ms")
asyncio.run(driver())
try:
    serve.shutdown()
except RuntimeError:  # the handle's loop is closed already
    pass
ray.shutdown()
