import sys, time, json, socket, statistics
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))  # the repository
from pathlib import Path
from bench.serving import running_server
from loadtest.prompts import load_prompts
CK = "checkpoints/shakespeare-small"
prompts, note = load_prompts(64, 8, None, CK, seed=0, shared_prefix_tokens=256, tenants=8)
def rt(host, port, method, path, body=None, sleep=0.05):
    data = json.dumps(body).encode() if body is not None else b""
    req = (f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode() + data
    s = socket.create_connection((host, port)); s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    time.sleep(sleep)
    t0 = time.perf_counter(); s.sendall(req); buf = b""
    while b"\r\n\r\n" not in buf: buf += s.recv(65536)
    t = time.perf_counter() - t0
    s.close(); return t * 1000
with running_server(CK, "cpu", "float32", Path(__import__("tempfile").gettempdir()) / "direct.log", ["--threads", "1"] + sys.argv[1:]) as url:
    host, port = url[7:].split(":"); port = int(port)
    for sleep in (0.05, 0.0):
        h = [rt(host, port, "GET", "/health", sleep=sleep) for _ in range(50)]
        tk = [rt(host, port, "POST", "/tokenize", {"prompt": p}, sleep=sleep) for p in prompts]
        print(f"sleep {sleep}: GET /health p50 {statistics.median(h):.2f} ms; POST /tokenize p50 {statistics.median(tk):.2f} ms")
