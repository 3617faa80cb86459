"""`python -m server.cluster`'s flags and the Serve config files, as settings and Serve options (no Ray
started: the flags are checked before Ray starts, and the options are what `build_app` hands Serve)."""

from __future__ import annotations

import pytest

pytest.importorskip("ray.serve")

from bench.tiny_checkpoint import main as make_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("cluster_config") / "tiny"
    make_tiny_checkpoint([str(path)])
    return path


def test_the_serve_config_files_deploy_the_same_application_with_autoscaling_from_flags(tmp_path, checkpoint):
    from pathlib import Path

    import yaml
    from ray.serve.schema import ServeDeploySchema

    from server.cli import cluster_settings_from as settings_from
    from server.cli import parse_cluster_args as parse_args
    from server.cluster.app import app_builder, argv_of, replica_options

    root = Path(__file__).resolve().parents[2]
    for name in ("serve_config.yaml", "rayservice.yaml"):
        doc = yaml.safe_load((root / "docs/cluster" / name).read_text())
        config = yaml.safe_load(doc["spec"]["serveConfigV2"]) if "spec" in doc else doc
        ServeDeploySchema.model_validate(config)  # as `serve run` / `serve deploy` / KubeRay read it
        (app,) = config["applications"]
        assert app["import_path"] == "server.cluster.app:app_builder"
        args = parse_args([f"--{k.replace('_', '-')}={v}" for k, v in app["args"].items()])
        assert args.router in ("kv", "pow2", "round-robin")
    s = settings_from(
        parse_args(
            [
                "--checkpoint",
                str(tmp_path),
                "--replicas",
                "3",
                "--min-replicas",
                "2",
                "--max-replicas",
                "6",
                "--target-ongoing-requests",
                "5",
                "--router",
                "kv",
                "--kv-cache-memory",
                "64MiB",
            ]
        )
    )
    opts = replica_options(s)
    auto = opts["autoscaling_config"]
    assert (auto.min_replicas, auto.max_replicas, auto.initial_replicas, auto.target_ongoing_requests) == (2, 6, 3, 5)
    assert "num_replicas" not in opts and s.engine.kv_cache_memory == 64 * 2**20
    assert opts["request_router_config"].request_router_kwargs["policy"] == "kv"
    engine_places = s.engine.max_num_seqs + s.engine.max_waiting
    assert s.feeds and opts["max_ongoing_requests"] == engine_places + 1  # one more: the ingress's feed
    assert opts["max_queued_requests"] == max(1, s.engine.max_waiting) + 1  # or the feed waiting for its place
    no_feeds = settings_from(parse_args(["--checkpoint", str(tmp_path), "--no-feeds"]))
    assert not no_feeds.feeds and replica_options(no_feeds)["max_ongoing_requests"] == engine_places
    pow2 = replica_options(settings_from(parse_args(["--router", "pow2"])))["request_router_config"]
    assert pow2.request_router_kwargs["policy"] == "pow2"  # our class, for the feeds; the choice is Serve's
    assert app_builder({"checkpoint": str(checkpoint), "replicas": 2}) is not None
    # the config's args checked as the command checks its flags, each problem a ValueError that says it
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        app_builder({"checkpoint": str(tmp_path), "replicas": 2})
    with pytest.raises(ValueError, match="not flags of python -m server.cluster: --no-such-flag 1"):
        app_builder({"no_such_flag": 1})
    # a config's lists, nulls and switches as the command line takes them
    s = settings_from(
        parse_args(
            argv_of(
                {
                    "checkpoint": str(tmp_path),
                    "served_model_name": ["a", "b"],
                    "cors_origin": ["http://x", "http://y"],
                    "max_replicas": None,
                    "speculative": "ngram",
                    "serve_proxy": False,
                }
            )
        )
    )
    assert (s.model_name, s.cors_origins, s.max_replicas) == (["a", "b"], ("http://x", "http://y"), None)


def test_autoscaling_flags_that_serve_would_refuse_are_refused_before_ray_starts(capsys):
    """Serve wants min ≤ initial ≤ max: the initial number defaults to 2 held within the bounds, and a
    --replicas or --min-replicas outside them is a usage error, not a traceback once Ray has started."""
    from server.cli import parse_cluster_args as parse_args

    assert parse_args([]).replicas == 2 and parse_args(["--replicas", "5"]).replicas == 5
    assert parse_args(["--max-replicas", "1"]).replicas == 1
    assert parse_args(["--min-replicas", "3", "--max-replicas", "8"]).replicas == 3
    for argv, message in (
        (["--replicas", "9", "--max-replicas", "8"], "must lie within"),
        (["--min-replicas", "5", "--max-replicas", "4"], "is above --max-replicas"),
    ):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err


def test_the_cli_forwards_the_engine_flags_and_checks_them_before_ray_starts(checkpoint, capsys):
    from server.cli import cluster_settings_from as settings_from
    from server.cli import parse_cluster_args as parse_args
    from server.cluster.__main__ import main
    from server.cluster.app import replica_options

    s = settings_from(
        parse_args(
            [
                "--checkpoint",
                str(checkpoint),
                "--quantization",
                "int8",
                "--target-step-ms",
                "20",
                "--speculative",
                "ngram",
                "--num-speculative-tokens",
                "3",
                "--prompt-lookup-min",
                "2",
                "--prompt-lookup-max",
                "3",
                "--kv-cache-dtype",
                "bfloat16",
                "--max-waiting",
                "7",
                "--served-model-name",
                "a",
                "b",
                "--max-new-tokens",
                "50",
                "--shutdown-grace",
                "12",
            ]
        )
    )
    e = s.engine
    assert (
        e.quantization,
        e.target_step_ms,
        e.speculative,
        e.num_speculative_tokens,
        e.prompt_lookup_min,
        e.prompt_lookup_max,
        e.kv_cache_dtype,
        e.max_waiting,
    ) == ("int8", 20.0, "ngram", 3, 2, 3, "bfloat16", 7)
    assert s.model_name == ["a", "b"] and s.limits.max_new_tokens == 50
    # --shutdown-grace: the ingress's drain and Serve's wait for a stopping replica's requests
    assert s.shutdown_grace == 12 and replica_options(s)["graceful_shutdown_timeout_s"] == 12
    # refused as `python -m server` refuses them (exit 2, one line), before any Ray process starts
    assert main(["--checkpoint", str(checkpoint.parent / "missing")]) == 2
    assert "not a complete checkpoint" in capsys.readouterr().err
    assert main(["--checkpoint", str(checkpoint), "--kv-cache-memory", "1KiB"]) == 2
    assert "kv-cache-memory" in capsys.readouterr().err.replace("_", "-")
    assert main(["--checkpoint", str(checkpoint), "--prompt-lookup-min", "5", "--prompt-lookup-max", "2"]) == 2
