"""Starting the Cleave application on Ray: `cleave serve`, and the Ray job entry point.

    ray job submit --working-dir . -- python -m cluster.launch --config deploy/examples/local.yaml

`deploy()` connects to Ray (`RAY_ADDRESS`, or a new local instance), starts Serve's HTTP and gRPC
proxies on the router's ports, deploys the application, and returns once it serves (a router
replica runs) or once every deployment runs, reporting progress and what it waits for (a
replica pending for resources, a failed one being replaced). `serve_forever()` (what `cleave
serve` runs) then says each change of the application's state and serves with whatever runs,
until Ctrl-C or SIGTERM takes everything down again, Ray included when it started it. Only an
explicit stop ends a deployment: one that fails or waits after it started serving is reported,
not torn down.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from cluster.app_state import APP_NAME, app_status, describe, gone_or_unknown, in_flight, serving
from cluster.config import CleaveConfig, ConfigError
from cluster.serve_config import build_serve_config

STATUS_EVERY_S = 5.0  # a serving application's state is re-read this often (said when it changes)


def _connect(num_cpus: float | None) -> bool:
    """Connect to `RAY_ADDRESS` or start a local Ray; True when this process started it."""
    import ray

    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS") or None
    # "local": a new instance even when another runs on this machine (None would join the one
    # `ray start` left, and stop nothing of it)
    kwargs: dict = {"address": address or "local", "log_to_driver": False}
    if address is None and num_cpus is not None:
        kwargs["num_cpus"] = num_cpus
    ray.init(**kwargs)
    return address is None


def deploy(config: CleaveConfig, *, num_cpus: float | None = None,
           progress: Callable[[str], None] | None = None,
           stop: threading.Event | None = None, proxy_location: str | None = None,
           until: str = "running") -> bool:
    """Deploy the application and wait until it runs (`until="running"`: every replica;
    `"serving"`: a router replica answers, whatever is still pending), or until `stop` is set;
    True when this process started Ray. A deployment waiting for resources is waited for, and
    said (`progress`); nothing is torn down once the application serves. Raises
    `RuntimeError` with Serve's message when it fails before ever serving."""
    import ray
    from ray import serve

    from cluster.app import build_app

    started_ray = _connect(num_cpus)
    proxies = build_serve_config(config)  # the proxies' options as `serve deploy` gets them
    serve.start(proxy_location=proxy_location or proxies["proxy_location"],
                http_options=proxies["http_options"],
                grpc_options=proxies["grpc_options"])
    try:
        serve._run(build_app(config.to_dict()), _blocking=False, name=APP_NAME,
                   route_prefix="/")
        _wait(until, progress, stop)
    except BaseException:
        if started_ray:
            serve.shutdown()
            ray.shutdown()
        raise
    return started_ray


def _wait(until: str, progress: Callable[[str], None] | None,
          stop: threading.Event | None) -> None:
    last = ""
    while not (stop is not None and stop.is_set()):
        try:
            app = app_status()
        except Exception:  # noqa: BLE001 -- the controller is still starting
            app, line = None, "starting Serve"
        else:
            line = describe(app)
        if progress is not None and line != last:
            progress(line)
            last = line
        state = "" if app is None else app.status.value
        if state == "RUNNING" or (until == "serving" and serving(app)):
            return
        if state == "DEPLOY_FAILED" and not serving(app):
            why = "; ".join(part for part in (app.message, line) if part)
            raise RuntimeError(f"the application failed to deploy: {why}")
        time.sleep(1.0)


def drain_timeout_s(config: CleaveConfig) -> float:
    """How long a shutdown lets requests in flight finish: the pools' longest drain."""
    return max((p.autoscaling.drain_timeout_s for _, p in config.pools.items()), default=0.0)


def shutdown(started_ray: bool, drain_s: float = 0.0,
             hurry: threading.Event | None = None) -> None:
    """Take the application down, and Ray when this process started it.

    With requests in flight, Serve deletes the application (the router finishes its streams,
    then the pools drain) for up to `drain_s`, or until `hurry` is set; then Serve and Ray go
    regardless. With none and Ray this process's, Ray stops at once: about 1.5 s, where
    Serve's deletion stops the deployments one after another (3-4 s more). `serve.shutdown`
    alone gives up after 30 s, whatever the drain timeout."""
    import ray
    from ray import serve

    hurry = hurry or threading.Event()
    try:
        if drain_s > 0 and ray.is_initialized() and in_flight():
            # not blocking: a blocking delete left in a thread past `ray.shutdown` would
            # start a new local Ray (Ray's auto-init) when it next polled
            serve.delete(APP_NAME, _blocking=False)
            deadline = time.monotonic() + drain_s
            while (not gone_or_unknown() and time.monotonic() < deadline
                   and not hurry.wait(0.2)):
                pass
        if not started_ray:
            serve.shutdown()
    finally:
        if started_ray:
            ray.shutdown()


def ready_message(config: CleaveConfig, model_name: str) -> str:
    r = config.router
    host = "127.0.0.1" if r.host in ("0.0.0.0", "::") else r.host
    auth = ' -H "Authorization: Bearer $CLEAVE_API_KEY"' if (r.api_keys or r.api_keys_env) else ""
    return (f"Cleave is serving {model_name}\n"
            f"  OpenAI HTTP: http://{host}:{r.http_port}/v1\n"
            f"  gRPC:        {host}:{r.grpc_port} (cleave.v1.Generation)\n"
            f"Try:\n"
            f"  curl http://{host}:{r.http_port}/v1/chat/completions{auth} "
            f"-H 'Content-Type: application/json' -d '{{\"model\": \"{model_name}\", "
            f"\"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}], "
            f"\"max_tokens\": 32}}'")


def serve_forever(config: CleaveConfig, *, num_cpus: float | None = None,
                  stop: threading.Event | None = None) -> int:
    """`cleave serve`: deploy, print the addresses, serve until SIGINT/SIGTERM (or `stop`),
    clean up; a second signal stops without waiting for requests in flight. Signals are
    caught only when called from the main thread."""
    stop = stop or threading.Event()

    def say(line: str) -> None:
        print(f"cleave: {line}", file=sys.stderr, flush=True)

    say("starting Ray and the application (the model loads in each pool replica)")
    started_ray = _connect(num_cpus)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        # after ray.init, which installs handlers of its own
        previous = {sig: signal.signal(sig, lambda *_: stop.set())
                    for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        deploy(config, progress=say, stop=stop, until="serving")
        if not stop.is_set():
            print(ready_message(config, model_name(config)), flush=True)
        watch(say, stop)
        say("shutting down (signal again to stop without waiting for requests in flight)")
        return 0
    finally:
        hurry = threading.Event()
        for sig in previous:  # a second signal: stop now
            signal.signal(sig, lambda *_: hurry.set())
        shutdown(started_ray, drain_timeout_s(config), hurry)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def watch(say: Callable[[str], None], stop: threading.Event) -> None:
    """Until `stop`: say the application's state whenever it changes (a replica lost and
    replaced, one still waiting for resources); a partial or failed deployment keeps serving
    with what runs, and only `stop` ends it."""
    last = ""
    while not stop.wait(STATUS_EVERY_S):
        try:
            line = describe(app_status())
        except Exception as exc:  # noqa: BLE001 -- the controller restarting: say so
            line = f"cannot read the application's state: {exc!r}"
        if line != last:
            say(line)
            last = line


def model_name(config: CleaveConfig) -> str:
    """The name clients pass as `model` (the router's `RouterConfig.model_name`)."""
    from cluster.settings import model_path, router_config

    return router_config(config, model_path(config)).model_name


def main(argv: list[str] | None = None) -> int:
    """`python -m cluster.launch --config FILE [--block]`: deploy to the Ray cluster in
    `RAY_ADDRESS` (a Ray job's driver), then return, or with `--block` serve until signalled."""
    parser = argparse.ArgumentParser(prog="python -m cluster.launch", description=main.__doc__)
    parser.add_argument("--config", required=True, help="a Cleave config YAML file")
    parser.add_argument("--block", action="store_true",
                        help="keep serving until SIGINT/SIGTERM, then take the app down")
    args = parser.parse_args(argv)
    try:
        config = CleaveConfig.from_yaml(args.config)
    except ConfigError as exc:
        print(f"cluster.launch: error: {exc}", file=sys.stderr)
        return 2
    if args.block:
        return serve_forever(config)
    deploy(config, progress=lambda line: print(f"cleave: {line}", file=sys.stderr, flush=True),
           until="serving")
    print(ready_message(config, model_name(config)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
