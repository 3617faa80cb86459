"""docker-compose.yml and the Dockerfile, checked as data (no Docker engine runs here)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def services():
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


def option(command, flag):
    return command[command.index(flag) + 1]


def test_cpu_service_serves_port_8000_with_a_healthcheck_and_the_mounted_checkpoint(services):
    cpu = services["kvserve"]
    assert "profiles" not in cpu, "the CPU service must start with a plain `docker compose up`"
    assert any(str(p).endswith(":8000") and "8000" in str(p).split(":")[-2] for p in cpu["ports"]), cpu["ports"]
    assert cpu["build"]["context"] == "."
    assert "/health" in " ".join(cpu["healthcheck"]["test"]) and cpu["healthcheck"]["test"][0] == "CMD"
    mounts = {v.split(":")[1]: v.split(":")[0] for v in cpu["volumes"]}
    command = cpu["command"]
    assert option(command, "--checkpoint").startswith("/checkpoints/") and mounts["/checkpoints"] == "./checkpoints"
    assert (option(command, "--host"), option(command, "--port"), option(command, "--device")) == (
        "0.0.0.0",
        "8000",
        "cpu",
    )


def test_gpu_variant_reserves_an_nvidia_device(services):
    gpu = services["kvserve-gpu"]
    assert gpu["profiles"] == ["gpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"] and devices[0]["count"] >= 1
    assert option(gpu["command"], "--device") == "cuda"
    assert "/health" in " ".join(gpu["healthcheck"]["test"])
    assert "/checkpoints" in " ".join(gpu["volumes"])


def test_dockerfile_runs_the_console_script_and_leaves_checkpoints_out():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "EXPOSE 8000" in dockerfile and "HEALTHCHECK" in dockerfile and 'ENTRYPOINT ["kvserve"]' in dockerfile
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {"checkpoints", ".venv", ".git"} <= set(ignored)
